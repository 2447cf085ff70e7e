"""WgradDispatcher on the CPU: semantics, backend hand-over, forcing."""

from __future__ import annotations

import logging

import pytest
import torch

from gemm_patch.gemm.backends import Backend, ExactFallbackBackend
from gemm_patch.gemm.dispatcher import WgradDispatcher, WgradOperandError


def operands(m=24, k=40, n=16, dtype=torch.bfloat16, out_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    grad_output = torch.randn(k, m, generator=gen).to(dtype)
    total_input = torch.randn(k, n, generator=gen).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=out_dtype)
    return grad_output.t(), total_input, out


def reference(a, b):
    return a.double() @ b.double()


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
def test_overwrite_into_fp32_is_exact_and_complete(in_dtype):
    a, b, out = operands(dtype=in_dtype)
    WgradDispatcher().gemm(a, b, out, accumulate=False)
    assert not out.isnan().any()
    assert rel(out, reference(a, b)) < 1e-6


def test_accumulate_adds_in_place():
    a, b, out = operands()
    out.fill_(1.0)
    WgradDispatcher().gemm(a, b, out, accumulate=True)
    assert rel(out, reference(a, b) + 1.0) < 1e-6


def test_same_dtype_keeps_torch_matmul_bitwise():
    a, b, out = operands(out_dtype=torch.bfloat16)
    WgradDispatcher().gemm(a, b, out, accumulate=False)
    assert torch.equal(out, torch.matmul(a, b))


def test_bf16_into_fp16_uses_the_exact_fallback():
    a, b, out = operands(out_dtype=torch.float16)
    d = WgradDispatcher()
    assert d.plan_for(a, b, out) == ("fallback",)
    d.gemm(a, b, out, accumulate=False)
    assert torch.equal(out, reference(a, b).float().half())


class RaisingBackend(Backend):
    """Fault injection: a backend that claims everything and fails at call time."""

    name = "te"

    def __init__(self):
        self.calls = 0

    def supports(self, a, b, out):
        return True

    def gemm(self, a, b, out, accumulate):
        self.calls += 1
        raise RuntimeError("injected failure")


def test_failing_backend_hands_over_once_and_the_gradient_is_written(caplog):
    failing = RaisingBackend()
    d = WgradDispatcher(backends={"te": failing, "fallback": ExactFallbackBackend()})
    with caplog.at_level(logging.WARNING, logger="gemm_patch"):
        for seed in range(3):
            a, b, out = operands(seed=seed)
            d.gemm(a, b, out, accumulate=False)
            assert rel(out, reference(a, b)) < 1e-6
    assert failing.calls == 1, "a demoted backend must not be retried for the same dtypes"
    warnings = [r for r in caplog.records if "injected failure" in r.getMessage()]
    assert len(warnings) == 1
    assert d.describe()["demoted"] == ["te for non-cuda float32 = bfloat16 x bfloat16"]


def test_shape_errors_are_raised_not_swallowed():
    failing = RaisingBackend()
    d = WgradDispatcher(backends={"te": failing, "fallback": ExactFallbackBackend()})
    a, b, _ = operands()
    with pytest.raises(WgradOperandError):
        d.gemm(a, b, torch.empty(3, 3), accumulate=False)
    assert d.describe()["demoted"] == []


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("case", ["3d_fp16", "wider_view_of_flat_fp32", "transposed", "int32", "mixed_operands"])
def test_a_wrong_main_grad_is_an_error_before_anything_is_written(case, accumulate):
    """torch's out= would resize a mis-shaped buffer: a (2, 24, 16) fp16 buffer got both halves
    written, a (24, 17) view of a flat fp32 buffer was reshaped to (24, 16) with its tail NaN."""
    a, b, _ = operands()  # (24, 40) @ (40, 16)
    flat = torch.full((2 * 24 * 17,), float("nan"))
    out = {"3d_fp16": torch.full((2, 24, 16), float("nan"), dtype=torch.float16),
           "wider_view_of_flat_fp32": flat[:24 * 17].view(24, 17),
           "transposed": torch.full((16, 24), float("nan")),
           "int32": torch.zeros(24, 16, dtype=torch.int32),
           "mixed_operands": torch.full((24, 16), float("nan"))}[case]
    if case == "mixed_operands":
        b = b.float()
    before = (out.shape, out.stride(), out.clone(), flat.clone())
    with pytest.raises(WgradOperandError, match="main_grad must be 24 x 16"):
        WgradDispatcher().gemm(a, b, out, accumulate=accumulate)
    assert (out.shape, out.stride()) == before[:2]
    assert torch.equal(out.isnan(), before[2].isnan()) and torch.equal(flat.isnan(), before[3].isnan())


def test_forced_backend_order_keeps_the_fallback_last():
    assert WgradDispatcher("native").order == ("native", "fallback")
    assert WgradDispatcher("fallback").order == ("fallback",)
    assert WgradDispatcher().order == ("native", "te", "fallback")
    assert WgradDispatcher(order=("te", "native", "fallback")).order == ("te", "native", "fallback")


def test_unavailable_forced_backend_warns_and_falls_back(caplog):
    a, b, out = operands()
    d = WgradDispatcher("native")
    with caplog.at_level(logging.WARNING, logger="gemm_patch"):
        d.gemm(a, b, out, accumulate=False)
    assert rel(out, reference(a, b)) < 1e-6
    assert any("GEMM_PATCH_BACKEND=native cannot be used" in r.getMessage() for r in caplog.records)


def test_the_dispatcher_follows_the_latest_apply(monkeypatch):
    """A new GEMM_PATCH_BACKEND, then apply() (again, or after revert()): the dispatcher runs in
    the order status() shows (0.3.0 kept the order of its first use)."""
    import gemm_patch
    from gemm_patch.gemm.active import active_dispatcher

    try:
        for backend, order, revert in (("fallback", ("fallback",), False), ("native", ("native", "fallback"), False),
                                       ("te", ("te", "fallback"), True), ("auto", ("native", "te", "fallback"), True)):
            monkeypatch.setenv("GEMM_PATCH_BACKEND", backend)
            if revert:
                gemm_patch.revert()
            st = gemm_patch.apply()
            assert active_dispatcher().order == order, backend
            assert st.backend == backend and st.backends["order"] == list(order), st.backends
    finally:
        monkeypatch.delenv("GEMM_PATCH_BACKEND")
        gemm_patch.revert()
        gemm_patch.apply()
