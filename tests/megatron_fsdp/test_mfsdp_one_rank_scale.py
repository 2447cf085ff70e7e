"""The mfsdp-one-rank-scale target against the standalone megatron-fsdp release on PYTHONPATH
(``megatron_fsdp``, no megatron-core; tests/megatron/test_one_rank_scale.py checks megatron-core's
copy the same way).

The release's own ``DataParallelBuffer`` objects over a one-process gloo group (slices of one
allocation, as ``buffer_all_in_one`` makes them) take a step's micro-batches; the release's own
``gradient_reduce_preprocessing`` runs per micro-batch (SUM over one rank is the identity, so no
collective is needed), then its own ``ParamAndGradBuffer.update_main_grads`` once, and the buffer
must hold factor x sum exactly. Its own callers of the preprocessing
(``ParamAndGradBuffer.all_reduce_gradients``/``reduce_scatter_gradients``) run too: from
Megatron-LM PR #6773 on they pass the group's size, and the preprocessing scales a one-rank
bucket itself.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import tempfile
import types

import pytest
from conftest import expected, torch

import gemm_patch
from gemm_patch.targets.one_rank_scale import STANDALONE

pytestmark = pytest.mark.proves("mfsdp-one-rank-scale")

pgb = pytest.importorskip(STANDALONE.buffers_module)
NAME = STANDALONE.name
EXPECT = expected(NAME)
PATCHED = EXPECT in ("verified", "compatible", "forced")
needs_patch = pytest.mark.skipif(not PATCHED, reason=f"{NAME} is {EXPECT} on this release")
FACTOR = 0.5  # EP = DP = 2: the experts' 1/dp over a one-rank expert data-parallel group
MICRO_BATCHES = 4
REDUCERS = ("all_reduce_gradients", "reduce_scatter_gradients")  # no_shard's, optim's (once per step)


@pytest.fixture(scope="module", autouse=True)
def registered_and_grouped():
    import torch.distributed as dist

    gemm_patch.revert()
    gemm_patch.apply()
    with tempfile.TemporaryDirectory() as tmp:
        owns = not dist.is_initialized()
        if owns:
            dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        yield
        if owns:
            dist.destroy_process_group()


@pytest.fixture
def without_this_target(monkeypatch):
    gemm_patch.revert()
    monkeypatch.setenv("GEMM_PATCH_DISABLE", NAME)
    gemm_patch.apply()
    yield
    gemm_patch.revert()
    monkeypatch.delenv("GEMM_PATCH_DISABLE")
    gemm_patch.apply()


def ddp_config(div_fusion: bool = True, average_in_collective: bool = False):
    """The package's own config (the fields this release has)."""
    from megatron_fsdp.distributed_data_parallel_config import DistributedDataParallelConfig

    wanted = dict(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
                  gradient_reduce_div_fusion=div_fusion, average_in_collective=average_in_collective)
    names = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    return DistributedDataParallelConfig(**{k: v for k, v in wanted.items() if k in names})


def buffers(factors=(FACTOR, None, 1.0), size: int = 16):
    """Real DataParallelBuffers over the one-rank WORLD group, one per factor, their data
    consecutive slices of one allocation."""
    made, whole = [], torch.zeros(size * len(factors))
    for i, factor in enumerate(factors):
        buf = pgb.DataParallelBuffer(ddp_config(), [torch.nn.Parameter(torch.zeros(size))], is_data_distributed=False,
                                     bucket_id=i, dtype=torch.float32, device=torch.device("cpu"),
                                     data_parallel_group=torch.distributed.group.WORLD,
                                     gradient_scaling_factor=factor)
        buf.data = whole[i * size:(i + 1) * size]  # init_data's assignment, without its size bookkeeping
        made.append(buf)
    return made


def micro_batch_grads(n: int = MICRO_BATCHES, size: int = 16):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(size, generator=gen) for _ in range(n)]


def owner(*owned, div_fusion: bool = True):
    """A ParamAndGradBuffer holding ``owned`` buffers (its parameter groups), no optimizer parameters."""
    return types.SimpleNamespace(ddp_config=ddp_config(div_fusion), optimizer_named_parameters=[],
                                 parameter_groups=[types.SimpleNamespace(main_grad_buffer=b) for b in owned])


def run_step(buf, grads, div_fusion: bool = True):
    """optim_grads(_params): the preprocessing after every backward, then update_main_grads once.
    Returns the ops the preprocessing chose."""
    ops = []
    for g in grads:
        buf.data.add_(g)
        ops.append(pgb.gradient_reduce_preprocessing(buf.data, buf.gradient_scaling_factor, ddp_config(div_fusion)))
    pgb.ParamAndGradBuffer.update_main_grads(owner(buf))
    return ops


def test_state_on_this_release():
    state = {t.name: t for t in gemm_patch.status().targets}[NAME]
    assert state.state == EXPECT, state.reason


@needs_patch
def test_factor_applied_once_per_step_over_micro_batches():
    scaled, plain, unit = buffers()
    grads = micro_batch_grads()
    ops = run_step(scaled, grads)
    assert all(op == torch.distributed.ReduceOp.SUM for op in ops)  # nothing left to NCCL
    want = FACTOR * torch.stack(grads).sum(0)
    assert torch.equal(scaled.data, want)
    pgb.ParamAndGradBuffer.update_main_grads(owner(scaled))  # finish_grad_sync again: no second scale
    assert torch.equal(scaled.data, want)
    assert not plain.data.any() and not unit.data.any()  # the neighbouring slices are untouched


@needs_patch
@pytest.mark.parametrize("method", REDUCERS)
def test_megatrons_own_reduce_scales_once(method):
    """Megatron-FSDP's own callers of the preprocessing, as they call it, over the one-rank group."""
    if "if gbuf is not None:" in inspect.getsource(getattr(pgb.ParamAndGradBuffer, method)):
        pytest.skip(f"this release's {method} reduces no buffer (upstream: `if gbuf is not None: continue`)")
    (scaled,) = buffers(factors=(FACTOR,))
    grads = micro_batch_grads()
    for g in grads:
        scaled.data.add_(g)
    chunk = owner(scaled)
    getattr(pgb.ParamAndGradBuffer, method)(chunk, async_op=False)
    pgb.ParamAndGradBuffer.update_main_grads(chunk)
    assert torch.equal(scaled.data, FACTOR * torch.stack(grads).sum(0))


@needs_patch
def test_other_buffers_keep_megatron_op():
    _, plain, unit = buffers()
    assert pgb.gradient_reduce_preprocessing(plain.data, None, ddp_config()) == torch.distributed.ReduceOp.SUM
    assert pgb.gradient_reduce_preprocessing(unit.data, 1.0, ddp_config()) != torch.distributed.ReduceOp.SUM
    (scaled,) = buffers(factors=(FACTOR,))
    avg = pgb.gradient_reduce_preprocessing(scaled.data, FACTOR, ddp_config(average_in_collective=True))
    assert avg == torch.distributed.ReduceOp.AVG


@needs_patch
def test_without_the_target_upstream_loses_or_compounds(without_this_target):
    """The bug, on the release's own code: the fused op goes to NCCL (which drops it on one
    rank), and with div fusion off the factor compounds over micro-batches."""
    (fused, manual) = buffers(factors=(FACTOR, FACTOR))
    assert all(op != torch.distributed.ReduceOp.SUM for op in run_step(fused, micro_batch_grads()))
    grads = micro_batch_grads()
    run_step(manual, grads, div_fusion=False)
    assert not torch.allclose(manual.data, FACTOR * torch.stack(grads).sum(0))
