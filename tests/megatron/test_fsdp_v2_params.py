"""Megatron-FSDP v2 (``fully_shard``; its fused wgrad is under review upstream) marks each parameter
``__fsdp_param__`` with ``get_main_grad``, ``overwrite_main_grad=False`` and ``zero_out_wgrad=True``,
and none of v1's buffer attributes. v1's rule (add only into v1's persistent buffer, else write
over) would overwrite there; gemm-patch follows the parameter's own ``overwrite_main_grad`` flag
instead, as Transformer Engine's layers do. The parameters are built as that design does; the
layer is megatron's real fused linear."""

from __future__ import annotations

import pytest
import torch
from conftest import APPLICABLE, layers

import gemm_patch

pytestmark = [pytest.mark.proves("fsdp-wgrad"),
              pytest.mark.skipif(not APPLICABLE, reason="fsdp-wgrad not applicable on this release")]


def v2_weight(overwrite: bool, out_features: int = 40, in_features: int = 24):
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16))
    main_grad = torch.randn(out_features, in_features, generator=gen)  # what earlier micro-batches left
    weight.__fsdp_param__ = True
    weight.get_main_grad = lambda: main_grad
    weight.main_grad = main_grad
    weight.overwrite_main_grad = overwrite
    weight.zero_out_wgrad = True
    return weight, main_grad


@pytest.mark.parametrize("overwrite", [False, True], ids=["adds", "writes_over"])
def test_a_v2_parameter_follows_its_own_overwrite_flag(overwrite, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # megatron's dummy without TE
    gemm_patch.apply()
    weight, main_grad = v2_weight(overwrite)
    before = main_grad.clone().double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, weight.shape[1], generator=gen).to(torch.bfloat16).requires_grad_()
    y = layers.linear_with_grad_accumulation_and_async_allreduce(
        x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False)
    g = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
    y.backward(g)
    wgrad = g.double().t() @ x.detach().double()
    expected = wgrad if overwrite else before + wgrad
    error = ((main_grad.double() - expected).norm() / expected.norm()).item()
    assert error < 1e-2, error
