"""Runs under one megatron-core release at a time (compat/matrix.py puts it on PYTHONPATH and
sets GEMM_PATCH_MATRIX_EXPECT to the state every target must read on it)."""

from __future__ import annotations

import contextlib
import gc
import json
import os

import pytest

torch = pytest.importorskip("torch")
layers = pytest.importorskip("megatron.core.tensor_parallel.layers")

import gemm_patch  # noqa: E402


def _expected_states() -> dict[str, str]:
    """{target: state} for this release: from compat/matrix.py (GEMM_PATCH_MATRIX_EXPECT, JSON),
    or, run by hand, by the same rule (each target's fingerprint table) for the megatron-core
    on sys.path."""
    if os.environ.get("GEMM_PATCH_MATRIX_EXPECT"):
        return json.loads(os.environ["GEMM_PATCH_MATRIX_EXPECT"])
    from gemm_patch.engine import detection
    from gemm_patch.targets import REGISTRY

    version = detection.distribution_version("megatron-core")
    return {t.name: t.expected_state(version) for t in REGISTRY if t.distribution == "megatron-core"}


EXPECTED = _expected_states()


def expected(target: str) -> str:
    return EXPECTED[target]


EXPECT = expected("fsdp-wgrad")
APPLICABLE = EXPECT != "not applicable"
DTYPE_ERROR = "Expected out tensor to have dtype"


def fsdp_weight(out_features: int, in_features: int, main_dtype, seed: int = 0):
    """A weight honouring Megatron-FSDP's parameter contract as the layer sees it: the
    ``__fsdp_param__`` marker and ``get_main_grad()`` returning the gradient buffer (here
    NaN-poisoned, so a partial write shows)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16))
    buffer = torch.full((out_features, in_features), float("nan"), dtype=main_dtype)
    weight.__fsdp_param__ = True
    weight.main_grad = buffer
    weight.get_main_grad = lambda: buffer
    return weight, buffer


def run_layer(main_dtype, tokens: int = 96, in_features: int = 64, out_features: int = 80, seed: int = 0):
    """Forward + backward through megatron's own fused-wgrad autograd function."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, in_features, generator=gen).to(torch.bfloat16).requires_grad_()
    weight, buffer = fsdp_weight(out_features, in_features, main_dtype, seed)
    y = layers.linear_with_grad_accumulation_and_async_allreduce(
        x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False,
        sequence_parallel=False,
    )
    grad_out = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
    y.backward(grad_out)
    reference = grad_out.double().t() @ x.detach().double()
    return {"y": y.detach(), "dgrad": x.grad, "main_grad": buffer, "reference": reference}


def asked_in_backward(param, ask):
    """``ask()`` answered where fsdp-wgrad's stand-ins ask it: inside a backward that accumulates
    into ``param.grad`` (some answers depend on it). ``param.grad`` is as it was, afterwards."""
    grad, answer = param.grad, []
    use = param * 1
    use.register_hook(lambda g: answer.append(ask()))
    use.float().sum().backward()
    param.grad = grad
    return answer[0]


@pytest.fixture(scope="session", autouse=True)
def frozen_imports():
    """What the imports built (torch, megatron: hundreds of thousands of objects), moved out of the
    collector's generations before the first test: the tests' full collections, and gemm_patch's
    search for instances built before apply() (``gc.get_referrers``), then walk only what the
    tests build: every model is built after this point (no test module builds one at import)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()  # for the interpreter's exit: extension objects (triton's) are finalized as usual


@pytest.fixture
def unpatched():
    gemm_patch.revert()
    yield
    gemm_patch.apply()


@pytest.fixture
def patched():
    gemm_patch.apply()
    yield


@contextlib.contextmanager
def applied_without(*names: str):
    """Every other target applied, ``names`` left out through GEMM_PATCH_DISABLE; the variable
    and the patches as they were afterwards."""
    saved = os.environ.get("GEMM_PATCH_DISABLE")
    gemm_patch.revert()
    os.environ["GEMM_PATCH_DISABLE"] = ",".join(names)
    gemm_patch.apply()
    try:
        yield
    finally:
        gemm_patch.revert()
        if saved is None:
            os.environ.pop("GEMM_PATCH_DISABLE", None)
        else:
            os.environ["GEMM_PATCH_DISABLE"] = saved
        gemm_patch.apply()
