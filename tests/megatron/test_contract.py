"""The target contract (tests/contract.py) for every megatron-core target, on this release."""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import megatron_cpu
import test_one_rank_scale as one_rank
import test_shared_weights as tied_lm
from conftest import EXPECTED, torch

from gemm_patch.targets import shared_grad

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import contract  # noqa: E402


def tied_model(module):
    """fsdp-shared-grad: a MegatronFSDP over a tied embedding/output weight under multi-token
    prediction, sharded (a fresh bucket per backward); its training is patched where every
    parameter's gradient matches fp64 autograd. megatron-core 0.14-0.15's own hooks fail loudly
    on a tied weight (and a failed backward leaves the instance held by autograd's graph), so
    there the output layer has a weight of its own, in one bucket with the others: upstream's
    hooks hand it on between its two uses and its second fused write overwrites the first."""
    tied = not tied_lm.per_module_call_hooks(shared_grad.TARGET, module)
    torch.manual_seed(0)
    model = tied_lm.TiedLM(tied=tied, mtp=True)
    obj = tied_lm.wrap(module, model, distributed=True, buckets="own" if tied else "shared")

    def trains_patched() -> bool:
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):  # megatron's dummy without TE
            _, got, ref, _ = tied_lm.run(model, obj)
        return all(tied_lm.rel(got[name], ref[name]) < tied_lm.TOL for name in got)
    return trains_patched


def one_rank_buffer(module):
    """fsdp-one-rank-scale: a DataParallelBuffer over the one-rank group with factor 0.5; its
    step is patched where the factor is applied once to the micro-batches' sum."""
    (buffer,) = one_rank.buffers(factors=(one_rank.FACTOR,))

    def trains_patched() -> bool:
        grads = one_rank.micro_batch_grads(one_rank.MICRO_BATCHES)
        one_rank.run_step(buffer, one_rank.ddp_config(), grads)
        return bool(torch.equal(buffer.data, one_rank.FACTOR * torch.stack(grads).sum(0)))
    return trains_patched


contract.define_tests(globals(), "megatron-core", EXPECTED,
                      built={"fsdp-shared-grad": tied_model, "fsdp-one-rank-scale": one_rank_buffer},
                      around=megatron_cpu.model_parallel)
