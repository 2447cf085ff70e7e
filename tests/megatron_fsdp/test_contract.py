"""The target contract (tests/contract.py) for every standalone megatron-fsdp target, on this release."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import test_mfsdp_one_rank_scale as one_rank
from conftest import EXPECTED, torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import contract  # noqa: E402


@contextlib.contextmanager
def one_rank_group():
    """A one-process gloo group (the WORLD group the buffers are built over)."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        owns = not dist.is_initialized()
        if owns:
            dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            if owns:
                dist.destroy_process_group()


def one_rank_buffer(module):
    """mfsdp-one-rank-scale: a DataParallelBuffer over the one-rank group with factor 0.5; its
    step is patched where the factor is applied once to the micro-batches' sum."""
    (buffer,) = one_rank.buffers(factors=(one_rank.FACTOR,))

    def trains_patched() -> bool:
        grads = one_rank.micro_batch_grads()
        one_rank.run_step(buffer, grads)
        return bool(torch.equal(buffer.data, one_rank.FACTOR * torch.stack(grads).sum(0)))
    return trains_patched


contract.define_tests(globals(), "megatron-fsdp", EXPECTED, built={"mfsdp-one-rank-scale": one_rank_buffer},
                      around=one_rank_group)
