"""A fresh import of megatron's layers module (``del sys.modules[...]``, then ``import``) while
megatron's code still holds what it imported from the first one: the function
``megatron.core.tensor_parallel`` re-exports and ``ColumnParallelLinear`` (GPTModel's
reference). Those old objects must keep gemm_patch's fix: a fused backward through them into a
persistent Megatron-FSDP buffer accumulates every micro-batch (unfixed, only the last one
survives: a relative error near 0.85 after four), and an fp32 main_grad does not crash on the
dtype. ``revert()`` then restores the old and the new module alike."""

from __future__ import annotations

import importlib
import sys

import megatron_cpu
import pytest
from conftest import APPLICABLE, torch

import gemm_patch
from gemm_patch.engine import patcher

NAME = "megatron.core.tensor_parallel.layers"
PACKAGE = "megatron.core.tensor_parallel"
MICRO_BATCHES = 4

pytestmark = [pytest.mark.skipif(not APPLICABLE, reason="release has no Megatron-FSDP wgrad call site"),
              pytest.mark.proves("fsdp-wgrad")]


class PersistentBuffer:
    """Megatron-FSDP's gradient buffer where the data is not distributed: ``fetch_bucket``
    returns its own storage, which sums the step's micro-batches (tests/megatron/
    test_fsdp_accumulate.py has the distributed kind too; this file needs nothing but megatron
    and gemm_patch's public API, so it also runs against older gemm_patch trees)."""

    is_data_distributed = False

    def __init__(self, numel: int, dtype) -> None:
        self.dtype = dtype
        self.data = torch.zeros(numel, dtype=dtype)

    def fetch_bucket(self, dtype=None):
        return self.data


@pytest.fixture
def cpu_dummy_wgrad(monkeypatch):
    # Without TE megatron allocates the dummy .grad on torch.cuda.current_device().
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def rel(got, ref) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def megatron_fsdp_param(out_features: int, in_features: int, main_dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16))
    return weight, fsdp_state(weight, main_dtype)


def fsdp_state(weight, main_dtype):
    """Give a weight the attributes Megatron-FSDP sets on an unsharded parameter."""
    gbuf = PersistentBuffer(weight.numel(), main_dtype)
    weight.__fsdp_param__ = True
    weight.grad_added_to_main_grad = False
    weight.overwrite_main_grad = True
    weight._gbuf = gbuf
    weight._item_id = 0
    weight.get_main_grad = lambda: weight._gbuf.fetch_bucket().view(weight.shape)
    return gbuf


def through_function(function, weight, seed=1):
    gen = torch.Generator().manual_seed(seed)
    exact = []
    for _ in range(MICRO_BATCHES):
        x = torch.randn(48, weight.shape[1], generator=gen).to(torch.bfloat16).requires_grad_()
        y = function(x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False,
                     sequence_parallel=False)
        grad_out = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
        y.backward(grad_out)
        exact.append(grad_out.double().t() @ x.detach().double())
        weight.grad, weight.grad_added_to_main_grad = None, False
    return sum(exact)


def through_layer(layer):
    total = 0
    for seed in range(MICRO_BATCHES):
        total = total + megatron_cpu.step(layer, seed)
        layer.weight.grad, layer.weight.grad_added_to_main_grad = None, False
    return total


@pytest.fixture
def fresh_import():
    """The objects megatron's code holds from the first import, then the module imported anew;
    afterwards the first module object is put back and patched as before."""
    gemm_patch.apply()
    from megatron.core.tensor_parallel import linear_with_grad_accumulation_and_async_allreduce as function
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    old, package = sys.modules[NAME], sys.modules[PACKAGE]
    del sys.modules[NAME]
    try:
        new = importlib.import_module(NAME)
        assert new is not old
        yield old, new, function, ColumnParallelLinear
    finally:
        gemm_patch.revert()
        sys.modules[NAME] = old
        package.layers = old
        seen = getattr(patcher._state, "seen", {}).get(NAME)  # the dropped module: not patched again
        if seen:
            seen[:] = [m for m in seen if m is old]
        gemm_patch.apply()


def backward_class(module):
    return vars(module.LinearWithGradAccumulationAndAsyncCommunication)["backward"]


@pytest.mark.parametrize("main_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("then", ["nothing", "revert and apply"])
def test_old_references_keep_the_fix(fresh_import, cpu_dummy_wgrad, main_dtype, then):
    """Also after revert() and apply(): apply() patches the earlier module object again, which
    megatron still runs (0.3.0 patched only the one in sys.modules and said verified)."""
    old, new, function, column_class = fresh_import
    if then == "revert and apply":
        gemm_patch.revert()
        gemm_patch.apply()
    dtype = getattr(torch, main_dtype)
    bound = 2 ** -7 if dtype == torch.bfloat16 else 1e-5

    weight, gbuf = megatron_fsdp_param(40, 32, dtype)
    total = through_function(function, weight)
    got = gbuf.data.view(weight.shape)
    assert rel(got, total) < bound, \
        f"the held function: main_grad off the {MICRO_BATCHES} micro-batches' sum by {rel(got, total):.3f}"

    with megatron_cpu.model_parallel():
        layer = column_class(64, 80, config=megatron_cpu.config(), init_method=torch.nn.init.xavier_normal_,
                             bias=False)
        gbuf = fsdp_state(layer.weight, dtype)
        total = through_layer(layer)
    got = gbuf.data.view(layer.weight.shape)
    assert rel(got, total) < bound, f"the held ColumnParallelLinear: off by {rel(got, total):.3f}"

    for target in ("fsdp-wgrad", "apex-wgrad"):
        st = {t.name: t for t in gemm_patch.status().targets}[target]
        assert st.state == "verified", st.reason


def test_revert_restores_the_old_and_the_new_module(fresh_import):
    old, new, *_ = fresh_import
    patched_old, patched_new = backward_class(old), backward_class(new)
    gemm_patch.revert()
    for module, patched in ((old, patched_old), (new, patched_new)):
        restored = backward_class(module)
        assert restored is not patched
        assert isinstance(restored, staticmethod) and getattr(restored, "_self_gemm_patch_target", None) is None, \
            f"{module.__name__}'s backward is still gemm_patch's"
        assert not getattr(vars(module).get("fused_weight_gradient_mlp_cuda"), "__gemm_patch_stand_in__", False)
    assert "fused_weight_gradient_mlp_cuda" not in sys.modules or not getattr(
        sys.modules["fused_weight_gradient_mlp_cuda"], "__gemm_patch_stand_in__", False)
