"""megatron-core 0.18+'s own TE call on the Megatron-FSDP path, with a persistent buffer
(``_gbuf.is_data_distributed`` False: no_shard, or one data-parallel rank) over 4 micro-batches,
and with a fresh buffer: prints JSON (rel. error of the sum against fp64; fingerprint bits of
the fresh-buffer result). Run with and without gemm_patch (GEMM_PATCH=0)."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from wgrad_probe import bit_fingerprint  # noqa: E402

if os.environ.get("GEMM_PATCH", "1") != "0":
    import gemm_patch  # noqa: F401
import megatron.core.tensor_parallel.layers as layers  # noqa: E402


def run(persistent: bool, micro_batches: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(11)
    weight = torch.nn.Parameter(torch.randn(384, 256, device="cuda", generator=gen).to(torch.bfloat16))
    main_grad = torch.zeros(384, 256, device="cuda") if persistent else \
        torch.full((384, 256), float("nan"), device="cuda")
    weight.__fsdp_param__ = True  # Megatron-FSDP's parameter contract
    weight._gbuf = SimpleNamespace(is_data_distributed=not persistent)
    weight.main_grad = main_grad
    weight.get_main_grad = lambda: main_grad
    expected = torch.zeros(384, 256, device="cuda", dtype=torch.float64)
    for _ in range(micro_batches):
        x = torch.randn(512, 256, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
        grad = torch.randn(512, 384, device="cuda", generator=gen).to(torch.bfloat16)
        y = layers.linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False)
        y.backward(grad)
        expected += grad.double().t() @ x.detach().double()
    torch.cuda.synchronize()
    return {"rel_err": float((main_grad.double() - expected).norm() / expected.norm()),
            "bits": bit_fingerprint(main_grad)}


def handed_back_then_fresh() -> dict:
    """A fresh buffer: one micro-batch through ``torch.autograd.grad`` with the weight among its
    inputs (no Megatron-FSDP hook runs, megatron's ``grad_added_to_main_grad`` stays set), then
    the next micro-batch into a new, unzeroed bucket (NaN here), which must be written over."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    weight = torch.nn.Parameter(torch.randn(384, 256, device="cuda", generator=gen).to(torch.bfloat16))
    main_grad = torch.full((384, 256), float("nan"), device="cuda")
    weight.__fsdp_param__ = True
    weight.grad_added_to_main_grad = False
    weight._gbuf = SimpleNamespace(is_data_distributed=True)
    weight.main_grad = main_grad
    weight.get_main_grad = lambda: main_grad
    for handed_back in (True, False):
        x = torch.randn(512, 256, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
        grad = torch.randn(512, 384, device="cuda", generator=gen).to(torch.bfloat16)
        y = layers.linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False)
        if handed_back:
            torch.autograd.grad(y, [weight], grad)
            main_grad.fill_(float("nan"))  # the next micro-batch's bucket: fetched, not zeroed
        else:
            y.backward(grad)
    expected = grad.double().t() @ x.detach().double()
    torch.cuda.synchronize()
    return {"rel_err": float((main_grad.double() - expected).norm() / expected.norm()),
            "bits": bit_fingerprint(main_grad)}


print(json.dumps({"persistent": run(True, 4), "fresh": run(False, 1), "handed_back": handed_back_then_fresh()}))
