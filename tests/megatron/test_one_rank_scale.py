"""The fsdp-one-rank-scale target against the real megatron-core release on PYTHONPATH.

Megatron-FSDP reduces a gradient buffer with ``gradient_reduce_preprocessing``'s op over the
buffer's data-parallel group. On a one-rank group (experts under EP = DP) the buffer is not
sharded and keeps the step's micro-batches summed; NCCL's one-rank reduce-scatter drops a
PreMulSum factor (measured on the H200, validation/probes/premul_one_rank.py), and megatron's other
branch, ``mul_`` at every reduce, compounds over micro-batches. The tests build the release's
own ``DataParallelBuffer`` objects over a one-process gloo group, slices of one allocation as
``buffer_all_in_one`` makes them, accumulate micro-batches into them, call the release's own
``gradient_reduce_preprocessing`` per micro-batch (the reduce of a one-rank group adds nothing:
SUM over one rank is the identity, so the collective itself is not needed), then the release's
own ``ParamAndGradBuffer.update_main_grads`` once, and compare with factor x sum exactly. Its own
callers of the preprocessing (``ParamAndGradBuffer.all_reduce_gradients``/``reduce_scatter_gradients``)
run too: from Megatron-LM PR #6773 on they pass the group's size, and the preprocessing scales a
one-rank bucket itself.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import tempfile
import types

import pytest
from conftest import EXPECTED, applied_without, torch

import gemm_patch
from gemm_patch.engine import detection
from gemm_patch.targets.one_rank_scale import TARGET

pytestmark = pytest.mark.proves("fsdp-one-rank-scale")

try:
    pgb = importlib.import_module(TARGET.buffers_module)
except ImportError:
    pgb = None

NAME = TARGET.name
EXPECT = EXPECTED.get(NAME) or TARGET.expected_state(detection.distribution_version("megatron-core"))
PATCHED = EXPECT in ("verified", "compatible", "forced")
needs_patch = pytest.mark.skipif(not PATCHED, reason=f"{NAME} is {EXPECT} on this release")
FACTOR = 0.5  # EP = DP = 2: the experts' 1/dp over a one-rank expert data-parallel group
MICRO_BATCHES = 4


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
def without_this_target():
    with applied_without(NAME):
        yield


def target_state():
    return {t.name: t for t in gemm_patch.status().targets}[NAME]


def ddp_config(div_fusion: bool = True, average_in_collective: bool = False):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
                                         gradient_reduce_div_fusion=div_fusion,
                                         average_in_collective=average_in_collective)


def buffers(dtype=torch.float32, factors=(FACTOR, None, 1.0), size: int = 16, module=None):
    """Real DataParallelBuffers over the one-rank WORLD group, one per factor, their data
    consecutive slices of one allocation (as ``buffer_all_in_one`` gives them). ``module``: the
    param_and_grad_buffer module (megatron-core's by default)."""
    import torch.distributed as dist

    module = module or pgb
    made, whole = [], torch.zeros(size * len(factors), dtype=dtype)
    for i, factor in enumerate(factors):
        param = torch.nn.Parameter(torch.zeros(size, dtype=dtype))
        buf = module.DataParallelBuffer(ddp_config(), [param], is_data_distributed=False, bucket_id=i, dtype=dtype,
                                        device=torch.device("cpu"), data_parallel_group=dist.group.WORLD,
                                        gradient_scaling_factor=factor)
        buf.data = whole[i * size:(i + 1) * size]  # init_data's assignment, without its size bookkeeping
        made.append(buf)
    return made


def micro_batch_grads(n: int, size: int = 16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(size, generator=gen).to(dtype) for _ in range(n)]


def run_step(buf, config, grads):
    """optim_grads(_params): a reduce after every backward, then finish_grad_sync's
    update_main_grads. Returns the ops the preprocessing chose."""
    ops = []
    for g in grads:
        buf.data.add_(g)
        ops.append(pgb.gradient_reduce_preprocessing(buf.data[: buf.data.numel()], buf.gradient_scaling_factor,
                                                     config))
    update(buf)
    return ops


def update(*owned):
    """The release's own update_main_grads on a ParamAndGradBuffer holding ``owned`` buffers
    (its parameter groups) and no optimizer parameters."""
    groups = [types.SimpleNamespace(main_grad_buffer=b) for b in owned]
    pgb.ParamAndGradBuffer.update_main_grads(types.SimpleNamespace(optimizer_named_parameters=[],
                                                                   parameter_groups=groups))


REDUCERS = ("all_reduce_gradients", "reduce_scatter_gradients")  # no_shard's, optim's (once per step)


def reduce_through_megatron(method: str, module=None):
    """A step's micro-batches summed into a one-rank buffer with the factor, then the module's
    own ``ParamAndGradBuffer.<method>`` (``REDUCERS``), which hands the buffer to
    ``gradient_reduce_preprocessing`` as that code does and runs the collective over the
    one-rank group, then its ``update_main_grads``. Returns the buffer's data and factor x sum."""
    module = module or pgb
    scaled, _, _ = buffers(module=module)
    grads = micro_batch_grads(MICRO_BATCHES)
    for g in grads:
        scaled.data.add_(g)
    owner = types.SimpleNamespace(ddp_config=ddp_config(), optimizer_named_parameters=[],
                                  parameter_groups=[types.SimpleNamespace(main_grad_buffer=scaled)])
    getattr(module.ParamAndGradBuffer, method)(owner, async_op=False)
    module.ParamAndGradBuffer.update_main_grads(owner)
    return scaled.data, FACTOR * torch.stack(grads).sum(0)


def test_state_on_this_release():
    assert target_state().state == EXPECT


@needs_patch
def test_factor_applied_once_per_step_over_micro_batches():
    scaled, plain, unit = buffers()
    grads = micro_batch_grads(MICRO_BATCHES)
    ops = run_step(scaled, ddp_config(), grads)
    assert all(op == torch.distributed.ReduceOp.SUM for op in ops)  # nothing left to NCCL
    expected = FACTOR * torch.stack(grads).sum(0)
    assert torch.equal(scaled.data, expected)
    # A second update (finish_grad_sync called again) does not scale again.
    update(scaled)
    assert torch.equal(scaled.data, expected)
    # The neighbouring slices of the same allocation were not touched.
    assert not plain.data.any() and not unit.data.any()


def reduces_nothing(method: str, module=None) -> bool:
    """megatron-core 0.14-0.17's ``all_reduce_gradients`` (0.14-0.15's ``reduce_scatter_gradients``
    too) skips every buffer: ``if gbuf is not None: continue``."""
    return "if gbuf is not None:" in inspect.getsource(getattr((module or pgb).ParamAndGradBuffer, method))


@needs_patch
@pytest.mark.parametrize("method", REDUCERS)
def test_megatrons_own_reduce_scales_once(method):
    """Megatron's own callers of the preprocessing, as they call it, over the one-rank group."""
    if reduces_nothing(method):
        pytest.skip(f"this release's {method} reduces no buffer (upstream: `if gbuf is not None: continue`)")
    got, expected = reduce_through_megatron(method)
    assert torch.equal(got, expected)


@needs_patch
def test_another_chunks_buffer_waits_for_its_own_update():
    mine, other = buffers(factors=(FACTOR, FACTOR))
    for buf in (mine, other):
        buf.data.add_(1.0)
        pgb.gradient_reduce_preprocessing(buf.data, FACTOR, ddp_config())
    update(mine)
    assert torch.equal(mine.data, torch.full_like(mine.data, FACTOR))
    assert torch.equal(other.data, torch.ones_like(other.data))  # not yet: its chunk's update comes
    update(other)
    assert torch.equal(other.data, torch.full_like(other.data, FACTOR))


@needs_patch
def test_bf16_buffer_no_longer_compounds():
    (scaled,) = buffers(dtype=torch.bfloat16, factors=(FACTOR,))
    grads = micro_batch_grads(MICRO_BATCHES, dtype=torch.bfloat16)
    run_step(scaled, ddp_config(), grads)
    summed = torch.zeros_like(scaled.data)
    for g in grads:
        summed.add_(g)
    assert torch.equal(scaled.data, summed * FACTOR)


@needs_patch
def test_other_buffers_keep_megatron_op():
    _, plain, unit = buffers()
    config = ddp_config()
    before = plain.data.clone()
    assert pgb.gradient_reduce_preprocessing(plain.data, None, config) == torch.distributed.ReduceOp.SUM
    # factor 1 is not recorded: megatron's fused PreMulSum op comes back unchanged
    op = pgb.gradient_reduce_preprocessing(unit.data, 1.0, config)
    assert op != torch.distributed.ReduceOp.SUM
    # a tensor outside every recorded buffer (a grad_comm_dtype copy) keeps megatron's op too
    copy = torch.zeros(16)
    assert pgb.gradient_reduce_preprocessing(copy, FACTOR, config) != torch.distributed.ReduceOp.SUM
    assert torch.equal(plain.data, before)
    assert target_state().state == EXPECT


@needs_patch
def test_average_in_collective_is_megatron_s():
    (scaled,) = buffers(factors=(FACTOR,))
    op = pgb.gradient_reduce_preprocessing(scaled.data, FACTOR, ddp_config(average_in_collective=True))
    assert op == torch.distributed.ReduceOp.AVG


@needs_patch
def test_without_the_target_upstream_loses_or_compounds(without_this_target):
    """The bug, on the release's own code: the fused op goes to NCCL (which drops it on one
    rank), and with div fusion off the factor compounds over micro-batches."""
    (fused,) = buffers(factors=(FACTOR,))
    ops = run_step(fused, ddp_config(), micro_batch_grads(MICRO_BATCHES))
    assert all(op != torch.distributed.ReduceOp.SUM for op in ops)  # PreMulSum, left to the collective
    (manual,) = buffers(factors=(FACTOR,))
    grads = micro_batch_grads(MICRO_BATCHES)
    run_step(manual, ddp_config(div_fusion=False), grads)
    assert not torch.allclose(manual.data, FACTOR * torch.stack(grads).sum(0))


@needs_patch
def test_revert_puts_back_megatron_functions():
    owners = ((pgb, "gradient_reduce_preprocessing"), (pgb.DataParallelBuffer, "__init__"),
              (pgb.ParamAndGradBuffer, "update_main_grads"))
    patched = {name: vars(owner)[name] for owner, name in owners}
    assert all(getattr(obj, "_self_gemm_patch_target", None) == NAME for obj in patched.values())
    gemm_patch.revert()
    try:
        for owner, name in owners:
            assert vars(owner)[name] is patched[name].__wrapped__
    finally:
        gemm_patch.apply()


@pytest.fixture
def reloaded_buffers_module():
    """megatron's buffers module run again (``importlib.reload``) while Megatron-FSDP's main
    module keeps the ``ParamAndGradBuffer`` class it imported by name; afterwards the module's
    first contents are put back, and gemm_patch applied as before."""
    gemm_patch.revert()
    first = dict(vars(pgb))
    gemm_patch.apply()
    try:
        importlib.reload(pgb)
        yield
    finally:
        gemm_patch.revert()
        vars(pgb).clear()
        vars(pgb).update(first)
        gemm_patch.apply()


@needs_patch
@pytest.mark.parametrize("then", ["apply", "revert and apply"])
def test_a_reloaded_buffers_module_scales_once_through_the_class_megatron_holds(reloaded_buffers_module, then):
    """After the reload, megatron builds its buffers from the reloaded module's class and
    preprocessing (global names there) and updates them through the ParamAndGradBuffer that
    megatron_fsdp imported before: apply() (what status advises) patches both, so the factor
    is applied once (0.3.0 unwrapped the held class: the gradient came out 1/factor = 2x)."""
    if then == "revert and apply":
        gemm_patch.revert()
    gemm_patch.apply()
    assert target_state().state == EXPECT
    held = vars(importlib.import_module(TARGET.module))["ParamAndGradBuffer"]
    assert held is not pgb.ParamAndGradBuffer  # the reload made a new class
    (scaled,) = buffers(factors=(FACTOR,))
    grads = micro_batch_grads(MICRO_BATCHES)
    for g in grads:
        scaled.data.add_(g)
        pgb.gradient_reduce_preprocessing(scaled.data, FACTOR, ddp_config())
    held.update_main_grads(types.SimpleNamespace(optimizer_named_parameters=[],
                                                 parameter_groups=[types.SimpleNamespace(main_grad_buffer=scaled)]))
    ratio = (scaled.data / (FACTOR * torch.stack(grads).sum(0))).mean().item()
    assert torch.allclose(scaled.data, FACTOR * torch.stack(grads).sum(0)), f"gradient {ratio:.3f}x the expected"


@needs_patch
def test_premul_sum_through_an_alias_is_unverified(tmp_path):
    """The same preprocessing with NCCL's PreMulSum reached through a module-level alias: the
    factor still goes to the collective, but no literal match. Unknown code reads unverified
    with its warning (0.3.0: not applicable, no warning, the factor lost on one rank)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from source_modules import load_edited_copy

    from gemm_patch.engine import config
    from gemm_patch.targets.one_rank_scale import PREMUL

    edited = load_edited_copy(tmp_path, pgb, PREMUL, "_premul_sum", append=f"\n_premul_sum = {PREMUL}\n")
    try:
        target = dataclasses.replace(TARGET, buffers_module=edited.__name__)
        st, undo = target.patch(importlib.import_module(TARGET.module),
                                detection.distribution_version("megatron-core"), config.Config())
        assert st.state == "unverified" and "another form" in st.reason, st.reason
        assert not undo.steps
    finally:
        sys.modules.pop(edited.__name__, None)


@needs_patch
@pytest.mark.parametrize("factor", [FACTOR, 2.0])
def test_a_buffer_built_before_apply_is_scaled_once(factor):
    """A one-rank buffer built before ``gemm_patch.apply()`` (a model built, then ``import
    gemm_patch``) never passed through the patched ``__init__``: apply() finds it and records it
    by the same rule, so its factor is applied once, as for a buffer built after (0.4.0: the
    factor was left to NCCL, which drops it on one rank: 2.000x at 0.5). revert() puts
    megatron's op back for it."""
    gemm_patch.revert()
    try:
        (early,) = buffers(factors=(factor,))
        settings = dict(vars(early))
    finally:
        gemm_patch.apply()
    assert target_state().state == EXPECT
    grads = micro_batch_grads(MICRO_BATCHES)
    ops = run_step(early, ddp_config(), grads)
    assert all(op == torch.distributed.ReduceOp.SUM for op in ops)
    expected = factor * torch.stack(grads).sum(0)
    ratio = (early.data / expected).mean().item()
    assert torch.equal(early.data, expected), f"gradient {ratio:.3f}x the expected"
    assert vars(early) == settings, "the buffer's own settings are untouched"
    gemm_patch.revert()
    try:
        assert pgb.gradient_reduce_preprocessing(early.data, factor, ddp_config()) != torch.distributed.ReduceOp.SUM
    finally:
        gemm_patch.apply()
