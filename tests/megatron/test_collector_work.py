"""Python's garbage collector gets no work from gemm-patch: micro-batches of megatron's real layers
under Megatron-FSDP's hooks (test_shared_weights.py's harness), fusion on under every fix, leave no
more reference cycles than fusion off does, so gemm-patch adds no collector pauses to a host-bound step
(benchmarks/gc_probe.py measures those pauses in pretrain_gpt.py)."""

from __future__ import annotations

import gc

import pytest
import test_shared_weights as harness
from conftest import torch
from test_shared_weights import BATCH, SEQ, VOCAB, TiedLM, needs_code, remove_hooks, wrap

fsdp, shared_on, parallel = harness.fsdp, harness.shared_on, harness.parallel
cpu_dummy_wgrad = harness.cpu_dummy_wgrad  # autouse: without TE, megatron puts its dummy on the CPU here

pytestmark = pytest.mark.proves("fsdp-wgrad", "fsdp-embedding-wgrad", "fsdp-shared-grad")

WARM, MEASURED = 3, 40


def cycles_per_micro_batch(module_fsdp, *, tied: bool, fusion: bool, leak=None) -> float:
    """Unreachable objects the collector finds after MEASURED micro-batches (its automatic runs off),
    per micro-batch; ``leak(tensor)``: a hook on the logits' gradient (the control)."""
    torch.manual_seed(0)
    model = TiedLM(tied, mtp=True, fusion=fusion)
    obj = wrap(module_fsdp, model, distributed=False)
    gen = torch.Generator().manual_seed(1)

    def micro_batch() -> None:
        logits = obj.module(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
        if leak is not None:
            logits[0].register_hook(leak)
        torch.autograd.backward(logits, [torch.randn(lg.shape, generator=gen).to(lg.dtype) for lg in logits])

    try:
        for _ in range(WARM):
            micro_batch()
        gc.collect()
        gc.disable()
        try:
            for _ in range(MEASURED):
                micro_batch()
            return gc.collect() / MEASURED
        finally:
            gc.enable()
    finally:
        remove_hooks(obj)


def a_cycle(grad):
    holder: dict = {}
    holder["self"] = holder  # one dict that refers to itself: garbage only the collector frees
    return grad


@needs_code
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_fused_micro_batches_leave_no_more_cycles_than_fusion_off(parallel, shared_on, tied):
    _, module = shared_on
    off = cycles_per_micro_batch(module, tied=tied, fusion=False)
    fused = cycles_per_micro_batch(module, tied=tied, fusion=True)
    assert fused <= off, f"fusion under gemm-patch leaves {fused} unreachable objects a micro-batch, fusion off {off}"
    # The measure sees a cycle when one is made: one per micro-batch more than without it.
    assert cycles_per_micro_batch(module, tied=tied, fusion=True, leak=a_cycle) >= fused + 1
