#!/usr/bin/env python
"""Train a small GPT with megatron-core only: Megatron-FSDP, TE layers, fp32 main grads and
gradient-accumulation fusion. Runs under torchrun on 1 or more GPUs.

    torchrun --nproc-per-node 1 -m validation.parity.train_gpt_fsdp --out run.json       # unpatched
    gemm-patch run -- torchrun --nproc-per-node 2 -m validation.parity.train_gpt_fsdp --out run.json

Unpatched, ``--fusion on --main-grads-dtype fp32`` fails (no apex: ColumnParallelLinear refuses
gradient_accumulation_fusion; with an apex stand-in: the output layer's
``torch.matmul(..., out=<fp32 main_grad>)`` dtype error). Nothing here catches it.

How the loop is wired (megatron-core 0.17.1; the same calls as Megatron-LM's pretrain loop):
  * model: GPTModel with ``get_gpt_layer_with_transformer_engine_spec()`` (every block a TE
    layer; the vocabulary projection is megatron-core's ColumnParallelLinear, the patched
    call site), wrapped in Float16Module (bf16) then ``FullyShardedDataParallel`` (the mcore
    adapter around MegatronFSDP; FSDP units = TransformerLayer for optim_grads_params).
  * optimizer: ``get_megatron_optimizer`` with ``use_distributed_optimizer=True``, which for
    Megatron-FSDP is the DistributedOptimizer over the FSDP DTensor parameters (TE FusedAdam
    inside); its ``step()`` copies main weights into the model weights
    (copy_main_weights_to_model_weights, i.e. what install_optimized_model_weights() does) and
    calls ``start_param_sync()``.
  * schedule: ``get_forward_backward_func()`` (forward_backward_no_pipelining for PP=1).
  * config hooks: ``finalize_model_grads_func = finalize_model_grads`` (calls
    finish_grad_sync: waits for the reduce-scatter / all-reduce and attaches the reduced
    grads to the optimizer's DTensor params), ``no_sync_func = model.no_sync`` (Megatron-FSDP
    keys ``is_last_microbatch`` off it, which decides when no_shard all-reduces),
    ``grad_sync_func = model.start_grad_sync``, ``param_sync_func = model.start_param_sync``,
    ``grad_scale_func = optimizer.scale_loss``. The no-pipelining schedule reads only
    no_sync_func, finalize_model_grads_func and grad_scale_func; grad/param_sync_func are set as
    Megatron-LM sets them and are consulted only by the pipelined schedules.
  * each step: ``model.zero_grad_buffer()``, ``optimizer.zero_grad()``, forward_backward,
    ``optimizer.step()``.

  * learning rate: megatron-core's ``OptimizerParamScheduler`` (as in Megatron-LM), linear warmup
    from 0 over ``--lr-warmup-steps`` steps to ``--lr``, then constant; step k trains with
    ``lr * min(1, k / warmup)``. Adam (0.9, ``--adam-beta2``, eps 1e-8), gradient clipping 1.0.

``--plan FILE`` runs several configurations one after another in this process (each with
its own model, optimizer and seeds), which saves the start-up cost per configuration. Only the
first configuration of a process has the GPU to itself: each run records the memory allocated
right before its model is built (``mem_baseline_bytes``) and its peak above that baseline, and
says which measurement is clean (``memory_method``). validation/e2e/run_e2e.sh starts every timed
configuration in its own process.

The TE-layer fix (Megatron-FSDP sets ``overwrite_main_grad=True`` on every unsharded parameter,
which makes TE's fused wgrad overwrite the persistent main_grad buffer) is gemm_patch's
``fsdp-te-overwrite`` target (off with ``GEMM_PATCH_TE_OVERWRITE=0`` in the process's
environment); this script only observes its effect (``te_overwrite_flags`` in the JSON) and
records ``gemm_patch.status()`` after the model is wrapped.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import step_probe  # the width benchmark's memory and profile probes
from validation.parity.gpt_model import (
    PARALLEL_KEYS,
    PatternData,
    build_configs,
    build_gpt,
    dump_gradients,
    init_parallel,
    tp_partition_dim,
    weights_hash,
)

HERE = Path(__file__).resolve().parent

RUN_KEYS = ("name", "fusion", "main_grads_dtype", "sharding", "steps", "micro_batches", "layers",
            "hidden", "seq", "vocab", "micro_batch_size", "seed", "lr", "lr_warmup_steps", "adam_beta2",
            "grad_dump", "wgrad_rule", "tied", "mtp_layers", "moe_experts", "moe_topk", "mode", "spec",
            # the layouts campaign: model parallelism (the same for every run of a process), the 0.19
            # fused grouped MLP, Megatron-FSDP's double buffer and communication overlap
            "tp", "cp", "ep", "sequence_parallel", "moe_fused", "double_buffer", "overlap", "recompute",
            # the width benchmark's probes (benchmarks/step_probe.py)
            "probe_dir", "probe_step", "te_dummy")
# Run keys that exist only when given (flag or --plan entry): absent, a run's config is unchanged.
OPTIONAL_RUN_KEYS = ("grad_div_fusion", "position_embedding", "fine_grained_param_gather")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default=None, help="label of the run in the JSON (default: from the flags)")
    p.add_argument("--fusion", choices=("on", "off"), default="on",
                   help="gradient_accumulation_fusion (TE fuse_wgrad_accumulation + megatron's fused wgrad)")
    p.add_argument("--main-grads-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="Megatron-FSDP main gradient buffer and gradient communication dtype")
    p.add_argument("--sharding", choices=("optim_grads_params", "optim_grads", "optim", "no_shard"),
                   default="optim_grads_params")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step and rank")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=2e-5,
                   help="peak learning rate after the warmup (validation/notes/e2e.md: 2e-4 and up spike)")
    p.add_argument("--lr-warmup-steps", type=int, default=3,
                   help="linear warmup from 0: step k uses lr * min(1, k / this)")
    p.add_argument("--adam-beta2", type=float, default=0.95)
    p.add_argument("--untimed-steps", type=int, default=2,
                   help="first steps left out of the step-time medians (kernel selection, allocator)")
    p.add_argument("--out", default="results.json", help="JSON written by rank 0")
    p.add_argument("--grad-dump", default=None,
                   help="after step 1's backward and finalize_model_grads, before the optimizer step: "
                        "torch.save each parameter's full reduced gradient (fp32, CPU) here (rank 0)")
    p.add_argument("--wgrad-rule", choices=("auto", "overwrite", "accumulate"), default="auto",
                   help="diagnostics, needs gemm_patch: force the fused output-layer wgrad to overwrite "
                        "(the pre-fix behaviour) or accumulate instead of gemm_patch's rule")
    p.add_argument("--tied", choices=("on", "off"), default="off",
                   help="share_embeddings_and_output_weights (tied: the weight is written by the "
                        "fused output-layer wgrad and by the embedding lookup's param.grad)")
    p.add_argument("--mtp-layers", type=int, default=0,
                   help="multi-token-prediction layers (mtp_num_layers; get_gpt_mtp_block_spec)")
    p.add_argument("--moe-experts", type=int, default=0,
                   help="MoE experts per layer (0: dense MLP); grouped GEMM, alltoall dispatcher")
    p.add_argument("--moe-topk", type=int, default=2)
    p.add_argument("--position-embedding", choices=("rope", "learned_absolute"), default=None,
                   help="default rope; learned_absolute is pretrain_gpt.py's default")
    p.add_argument("--mode", choices=("train", "autograd", "fp64"), default="train",
                   help="autograd: oracle 2 instead of training (autograd_oracle.py): "
                        "the same model and initial weights without Megatron-FSDP, rank 0 runs every rank's "
                        "micro-batches of step 1 by plain autograd and dumps the fp32-summed gradients; fp64: "
                        "the same in float64 with megatron's local layers (a dense model without model "
                        "parallelism)")
    p.add_argument("--spec", choices=("te", "local"), default="te",
                   help="layer spec: TE layers (default) or megatron-core's local layers (CPU dry runs)")
    p.add_argument("--plan", default=None,
                   help="JSON list of runs, each a dict of the flags above (dest names) overriding the "
                        "command line; all run in this process, one after another")
    p.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size")
    p.add_argument("--cp", type=int, default=1, help="context_parallel_size (sequence split zigzag over CP ranks)")
    p.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size")
    p.add_argument("--sequence-parallel", choices=("on", "off"), default="off", help="with --tp > 1")
    p.add_argument("--moe-fused", choices=("none", "off", "on"), default="none",
                   help="the layouts campaign's MoE: 'on' = megatron-core 0.19's fused grouped MLP "
                        "(use_transformer_engine_"
                        "op_fuser, fused weighted squared ReLU), 'off' = the same model (squared ReLU) unfused; "
                        "'none' = the tied-weights campaign's MoE (GELU)")
    p.add_argument("--double-buffer", choices=("on", "off"), default="off", help="DDP config fsdp_double_buffer")
    p.add_argument("--overlap", choices=("on", "off"), default="on",
                   help="overlap_grad_reduce and overlap_param_gather (Megatron-FSDP forces both on for "
                        "optim_grads_params)")
    p.add_argument("--recompute", choices=("none", "full"), default="none",
                   help="activation recomputation: 'full' = every transformer layer (recompute_granularity full, "
                        "method uniform, 1 layer per chunk); the MoE 'before' needs it: the recomputed "
                        "forward re-runs 0.19's fused-MLP hook after Megatron-FSDP's pre-backward unshard")
    p.add_argument("--leave-out-target", action="append", default=[], metavar="NAME",
                   help="needs gemm_patch: revert, add this target to GEMM_PATCH_DISABLE and apply again "
                        "at start-up (the 'before' of one target; run_coverage.py sets GEMM_PATCH_DISABLE "
                        "in the process's environment instead)")
    p.add_argument("--probe-dir", default=None,
                   help="memory history up to step --probe-step and a profile of the step after it "
                        "(benchmarks/step_probe.py), written by rank 0 into this folder")
    p.add_argument("--probe-step", type=int, default=3)
    p.add_argument("--te-dummy", choices=("cached", "fresh"), default="cached",
                   help="experiment: 'fresh' makes TE's get_dummy_wgrad allocate per call instead "
                        "of its per-shape cache (not a gemm_patch feature)")
    p.add_argument("--grad-div-fusion", choices=("on", "off"), default=None,
                   help="DDP config gradient_reduce_div_fusion (default: megatron-core's, True); the "
                        "ep2_moe probe repeats with 'off' (explicit mul_ instead of NCCL PreMulSum)")
    p.add_argument("--fine-grained-param-gather", choices=("on", "off"), default=None,
                   help="DDP config megatron_fsdp_enable_fine_grained_param_gather (megatron-core 0.19+): "
                        "every module unshards its own weights")
    p.add_argument("--reduce-probe", default=None, metavar="PATH",
                   help="observe Megatron-FSDP's per-bucket gradient scaling and reduction "
                        "(validation/probes/ep2_reduce_probe.py); rank 0 writes every rank's record to PATH (JSON)")
    p.add_argument("--require-patch", action="store_true",
                   help="fail at once unless gemm_patch is imported and its fsdp-wgrad target is patched")
    return p.parse_args(argv)


def expand_plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = {k: getattr(args, k) for k in RUN_KEYS}
    base.update({k: getattr(args, k) for k in OPTIONAL_RUN_KEYS if getattr(args, k, None) is not None})
    overrides = json.loads(Path(args.plan).read_text()) if args.plan else [{}]
    runs = []
    for i, override in enumerate(overrides):
        unknown = set(override) - set(RUN_KEYS) - set(OPTIONAL_RUN_KEYS)
        if unknown:
            raise SystemExit(f"--plan entry {i}: unknown keys {sorted(unknown)}; known: {RUN_KEYS}")
        run = {**base, **override}
        if not run["name"]:
            run["name"] = f"fusion-{run['fusion']}_{run['main_grads_dtype']}_{run['sharding']}"
        runs.append(run)
    return runs


# -- configuration ------------------------------------------------------------------------------


# -- data ---------------------------------------------------------------------------------------


def cp_slice(x, cp_size: int, cp_rank: int):
    """Context parallelism's split of dim 1 (megatron.core.utils.get_batch_on_this_cp_rank's
    load-balanced zigzag, written out: its signature differs between releases)."""
    import torch

    chunks = x.chunk(2 * cp_size, dim=1)
    return torch.cat((chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]), dim=1).contiguous()


# -- diagnostics contexts -----------------------------------------------------------------------

def _persistence_rule():
    """gemm_patch's rule when importable, else the same rule written out (the script has to run
    without gemm_patch too)."""
    if "gemm_patch" in sys.modules:  # loaded, never imported here: importing gemm_patch applies it
        from gemm_patch.upstream.fsdp_rules import main_grad_is_persistent
        return main_grad_is_persistent
    else:
        def main_grad_is_persistent(param) -> bool:
            gbuf = getattr(param, "_gbuf", None)
            return gbuf is not None and not getattr(gbuf, "is_data_distributed", True)
        return main_grad_is_persistent


@contextlib.contextmanager
def wgrad_rule(rule: str, counts: dict[str, int]):
    """Count (and optionally force) gemm_patch's accumulate/overwrite decision for the fused
    output-layer wgrad. A no-op when gemm_patch is not loaded (nothing calls the rule then).

    The rule is ``gemm_patch.upstream.fsdp_rules.wgrad_accumulates``; only the fsdp-wgrad target's
    own reference to it (``gemm_patch.targets.fsdp_wgrad.wgrad_accumulates``) is replaced, and only
    the calls of ``fsdp_wgrad`` (megatron's output-layer call site) are counted or forced: the
    fsdp-te-overwrite target reads the rules for the TE layers through its own reference and
    keeps its answer (``GEMM_PATCH_TE_OVERWRITE=0`` is the way to turn that one off)."""
    module = sys.modules.get("gemm_patch.targets.fsdp_wgrad")
    if module is None or not hasattr(module, "wgrad_accumulates"):
        if rule != "auto":
            raise SystemExit(f"--wgrad-rule {rule} needs gemm_patch with its fsdp-wgrad target loaded "
                             "(run under `gemm-patch run --`)")
        yield
        return
    original = module.wgrad_accumulates
    forced = {"auto": None, "overwrite": False, "accumulate": True}[rule]

    def counted(param) -> bool:
        if sys._getframe(1).f_code.co_name != "fsdp_wgrad":  # the output layer's call site only
            return original(param)
        decision = original(param) if forced is None else forced
        counts["accumulate" if decision else "overwrite"] += 1
        return decision

    module.wgrad_accumulates = counted
    try:
        yield
    finally:
        module.wgrad_accumulates = original


@contextlib.contextmanager
def observe_te_overwrite(model, counts: dict[str, int]):
    """Observe, without changing anything, what TE will read in forward: after each
    ``MegatronFSDP.all_gather_and_wait_parameters_ready`` (which sets
    ``overwrite_main_grad = True`` on every parameter it unshards, megatron_fsdp.py:475 in
    0.17.1, and which gemm_patch's fsdp-te-overwrite target wraps), count the parameters whose
    flag is True although their main_grad is the persistent buffer (the TE-layer bug: only the
    last micro-batch's weight gradient survives) and those where it is False. The wrapper is
    installed on the class of the model's own MegatronFSDP instance, over whatever is there
    (the target's wrapper or megatron's function), and the exact previous attribute is put back."""
    fsdp_cls = next((type(m) for m in model.modules() if type(m).__name__ == "MegatronFSDP"), None)
    name = "all_gather_and_wait_parameters_ready"
    if fsdp_cls is None or not hasattr(fsdp_cls, name):
        counts["observer"] = "no MegatronFSDP instance in the model"
        yield
        return
    persistent = _persistence_rule()
    existed = name in vars(fsdp_cls)
    previous = vars(fsdp_cls).get(name)
    current = getattr(fsdp_cls, name) if not existed else previous
    where = f"{getattr(current, '__module__', '?')}.{getattr(current, '__qualname__', type(current).__name__)}"
    counts["observer"] = f"{fsdp_cls.__module__}.{fsdp_cls.__qualname__}.{name} = {where}"

    def all_gather_and_wait_parameters_ready(self, params, *args, **kwargs):
        params = list(params)
        result = current.__get__(self, type(self))(params, *args, **kwargs)
        for p in params:
            if persistent(p):
                key = "persistent_flag_true" if getattr(p, "overwrite_main_grad", False) else "persistent_flag_false"
                counts[key] += 1
        return result

    setattr(fsdp_cls, name, all_gather_and_wait_parameters_ready)
    try:
        yield
    finally:
        if existed:
            setattr(fsdp_cls, name, previous)
        else:
            delattr(fsdp_cls, name)


def install_mesh_helper_if_no_einops() -> bool:
    """megatron-core's FSDP adapter builds its (dp, tp) DeviceMesh with einops, which the
    megatron-core wheel lists only as an extra. For TP = EP = 1 that mesh is the ranks in a
    column; supply it without einops rather than fail. Returns True when the stand-in is used."""
    try:
        import einops  # noqa: F401
        return False
    except ImportError:
        pass
    import torch
    import torch.distributed as dist
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    def _get_dp_tp_mesh(dp_cp_group, tp_group, ep_size=1):
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        if tp != 1 or ep_size != 1 or dp_cp_group.size() != dist.get_world_size():
            raise RuntimeError("einops is missing and the stand-in mesh covers only TP = EP = 1")
        return torch.arange(dist.get_world_size()).reshape(-1, 1)

    mcore_fsdp_adapter._get_dp_tp_mesh = _get_dp_tp_mesh
    return True


# -- gradient gathering -------------------------------------------------------------------------


# -- one configuration --------------------------------------------------------------------------

def train_one(run: dict[str, Any], untimed_steps: int, first_in_process: bool,
              reduce_probe=None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import FullyShardedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import get_model_config

    rank, world = dist.get_rank(), dist.get_world_size()
    dp_group = parallel_state.get_data_parallel_group()
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    tconfig, ddp_config, opt_config = build_configs(run)

    # Memory baseline: whatever earlier configurations of this process left allocated (nothing
    # for the first one). Peaks are reported raw and above this baseline.
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.tensor([torch.cuda.memory_allocated()], device="cuda", dtype=torch.float64)
    dist.all_reduce(baseline, op=dist.ReduceOp.MAX)
    mem_baseline = int(baseline.item())

    # Same seed -> same initial weights in every configuration (TP = 1: no per-rank offset).
    torch.manual_seed(run["seed"])
    model_parallel_cuda_manual_seed(run["seed"])

    probe = step_probe.StepProbe(run, rank)
    step_probe.start_memory_history(run)
    te_dummy_rebound = step_probe.fresh_te_dummies() if run.get("te_dummy") == "fresh" else None

    gpt = build_gpt(run, tconfig)
    gpt.cuda(torch.cuda.current_device())
    init_hash = weights_hash(gpt)
    tp_dims = {n: tp_partition_dim(p) for n, p in gpt.named_parameters()}  # before FSDP replaces them
    moe_path = sorted({"fused grouped MLP (TE op fuser)" if getattr(m, "_with_fused_impl", False)
                       else type(m).__name__ for m in gpt.modules()
                       if type(m).__name__ in ("TEGroupedMLP", "GroupedMLP", "SequentialMLP")})
    model = FullyShardedDataParallel(config=tconfig, ddp_config=ddp_config, module=Float16Module(tconfig, gpt))
    main_grad_dtypes = _main_grad_dtypes(model)
    # Megatron-FSDP's own flag (the adapter's module): proves the fine-grained unshard hooks ran.
    fine_grained_hook = getattr(getattr(model, "module", None), "enable_fine_grained_param_gather_hook", None)
    optimizer = get_megatron_optimizer(opt_config, [model])
    # Linear warmup from 0, then constant (megatron-core's scheduler, as Megatron-LM uses it).
    # It sets every param group's lr at construction (num_steps = 0: lr 0) and on each step(1);
    # step(1) is called before each optimizer step, so step k trains with lr * min(1, k / W).
    warmup = max(0, int(run["lr_warmup_steps"]))
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=run["lr"], min_lr=run["lr"], lr_warmup_steps=warmup,
        lr_decay_steps=max(run["steps"], warmup + 1), lr_decay_style="constant",
        start_wd=0.0, end_wd=0.0, wd_incr_steps=max(run["steps"], 1), wd_incr_style="constant",
    )
    # gemm_patch's state now that Megatron-FSDP is imported and the model wrapped: the
    # fsdp-te-overwrite target is resolved by now (it is "pending" before the FSDP import).
    gp = sys.modules.get("gemm_patch")
    gemm_patch_status = gp.status().as_dict() if gp is not None else None

    config = get_model_config(model)
    config.no_sync_func = model.no_sync
    config.grad_sync_func = model.start_grad_sync
    config.param_sync_func = model.start_param_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    forward_backward = get_forward_backward_func()

    data = PatternData(run["vocab"], run["seq"], run["seed"])
    mbs, m = run["micro_batch_size"], run["micro_batches"]
    tokens_per_step = dp_size * m * mbs * run["seq"]
    position_ids = torch.arange(run["seq"], device="cuda").unsqueeze(0).expand(mbs, -1)

    cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()  # every token counts (no padding)
        logged = loss.detach().clone()  # the schedule divides the returned loss in place: log a copy
        if cp_size > 1:
            # megatron's convention for a 2-tuple loss: the schedule multiplies it by the CP size
            # (pipeline_parallel/schedules.py:272 in 0.17.1, :340 in 0.19.2) and Megatron-FSDP
            # divides the gradients by the DP x CP size, so the loss must be this rank's token sum
            # over the whole sequence's token count: the local mean / cp. Returning the local mean
            # doubles every gradient of cp2.
            loss = loss / cp_size
        return loss, {"lm loss": logged}

    def forward_step(data_iterator, model_):
        if reduce_probe is not None:
            reduce_probe.next_micro()
        tokens = next(data_iterator)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        pos = position_ids
        if cp_size > 1:  # this CP rank's part of the sequence: chunks r and 2 cp - 1 - r of 2 cp
            inputs, labels, pos = (cp_slice(x, cp_size, cp_rank) for x in (inputs, labels, position_ids))
        output = model_(inputs, pos, None, labels=labels)
        return output, loss_func

    counts: dict[str, Any] = {"accumulate": 0, "overwrite": 0}
    te_flags: dict[str, Any] = {"persistent_flag_true": 0, "persistent_flag_false": 0}
    steps, dump = [], None
    with observe_te_overwrite(model, te_flags), wgrad_rule(run["wgrad_rule"], counts):
        for step in range(1, run["steps"] + 1):
            batch = data.global_batch(step, dp_size * m * mbs)
            local = batch[dp_rank * m * mbs:(dp_rank + 1) * m * mbs].cuda(non_blocking=True)
            micro = [local[i * mbs:(i + 1) * mbs] for i in range(m)]
            if reduce_probe is not None:
                reduce_probe.set_step(step)
            scheduler.step(1)
            lr = _first_lr(optimizer)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            probe.begin(step)
            t0 = time.perf_counter()
            model.zero_grad_buffer()
            optimizer.zero_grad()
            losses = forward_backward(
                forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
                num_microbatches=m, seq_length=run["seq"], micro_batch_size=mbs, forward_only=False,
            )
            paused, peak_before_dump = 0.0, 0
            if step == 1 and run["grad_dump"]:
                # The dump's gather buffers are not training memory: keep them out of the peak.
                torch.cuda.synchronize()
                t_pause = time.perf_counter()
                peak_before_dump = torch.cuda.max_memory_allocated()
                dump = dump_gradients(model, run["grad_dump"], {"run": run, "world_size": world}, tp_dims,
                                      int(run.get("moe_experts") or 0))
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                paused = time.perf_counter() - t_pause
            update_ok, grad_norm, _ = optimizer.step()
            torch.cuda.synchronize()
            step_time = time.perf_counter() - t0 - paused
            reserved = torch.cuda.max_memory_reserved()
            probe.end(step)

            loss = torch.stack([x["lm loss"] for x in losses]).mean()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_group)
            # The step's peak and what stays allocated after it (model, optimizer state, buffers).
            mem = torch.tensor([max(peak_before_dump, torch.cuda.max_memory_allocated()),
                                torch.cuda.memory_allocated()], device="cuda", dtype=torch.float64)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            peak, allocated = mem
            record = {
                "step": step,
                "loss": float(loss),
                "step_time_s": step_time,
                "tokens_per_s": tokens_per_step / step_time,
                "peak_mem_bytes": int(peak.item()),
                "peak_mem_above_baseline_bytes": int(peak.item()) - mem_baseline,
                "allocated_bytes": int(allocated.item()),
                "peak_reserved_bytes": reserved,
                "lr": lr,
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "update_ok": bool(update_ok),
            }
            steps.append(record)
            if rank == 0:
                print(f"[{run['name']}] step {step:3d} loss {record['loss']:.4f} "
                      f"time {step_time * 1e3:7.1f} ms  {record['tokens_per_s']:,.0f} tok/s  "
                      f"peak {record['peak_mem_bytes'] / 2**30:.2f} GiB  lr {lr:.2e}  "
                      f"grad_norm {record['grad_norm']}",
                      flush=True)

    timed = steps[untimed_steps:] if len(steps) > untimed_steps else steps
    summary = {
        "median_step_time_s": statistics.median(s["step_time_s"] for s in timed),
        "median_tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed),
        "peak_mem_bytes": max(s["peak_mem_bytes"] for s in steps),
        "peak_mem_above_baseline_bytes": max(s["peak_mem_above_baseline_bytes"] for s in steps),
        "peak_reserved_bytes": max(s["peak_reserved_bytes"] for s in steps),
        "mem_baseline_bytes": mem_baseline,
        # "own process": the first configuration of its process, nothing else allocated before
        # it; "baseline-subtracted": later in a shared process, where earlier configurations
        # may leave memory behind (use peak_mem_above_baseline_bytes).
        "memory_method": "own process" if first_in_process else "baseline-subtracted (shared process)",
        "first_loss": steps[0]["loss"],
        "final_loss": steps[-1]["loss"],
        "timed_steps": len(timed),
    }

    # Let the overlapped all-gather launched by optimizer.step() finish before tearing down.
    model.stop_communication()
    torch.cuda.synchronize()
    for key in ("no_sync_func", "grad_sync_func", "param_sync_func", "finalize_model_grads_func",
                "grad_scale_func"):
        setattr(config, key, None)
    del scheduler, optimizer, model, gpt, forward_backward, config
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dist.barrier()
    return {
        "name": run["name"],
        "config": run,
        "world_size": world,
        "init_hash": init_hash,
        "moe_path": moe_path,  # the experts' implementation that ran ([] for a dense model)
        # The dtypes of Megatron-FSDP's main gradient buffers as built (fp32 expected with
        # main_grads_dtype fp32).
        "main_grad_buffer_dtypes": main_grad_dtypes,
        "fine_grained_param_gather_hook": fine_grained_hook,
        "tokens_per_step": tokens_per_step,
        "steps": steps,
        "summary": summary,
        "grad_dump": dump,
        "probe": probe.result or None,
        "te_dummy_rebound": te_dummy_rebound,
        "wgrad_decisions": {"output_layer_accumulate": counts["accumulate"],
                            "output_layer_overwrite": counts["overwrite"]},
        # After each unshard: parameters with a persistent main_grad whose overwrite_main_grad is
        # still True (TE overwrites them: the bug) or False (TE accumulates: fixed or never set).
        "te_overwrite_flags": te_flags,
        "gemm_patch_te_overwrite_env": os.environ.get("GEMM_PATCH_TE_OVERWRITE"),
        "gemm_patch_after_wrap": gemm_patch_status,
    }


def _main_grad_dtypes(model) -> list[str]:
    """The dtypes of the model's Megatron-FSDP main gradient buffers (best effort: [] when the
    buffer layout is not the expected one)."""
    dtypes: set[str] = set()
    try:
        for m in model.modules():
            buf = getattr(m, "param_and_grad_buffer", None)
            for group in getattr(buf, "parameter_groups", None) or []:
                gbuf = getattr(group, "main_grad_buffer", None)
                if gbuf is not None:
                    dtypes.add(str(getattr(gbuf, "dtype", None)))
    except Exception as exc:  # noqa: BLE001 - a diagnostic, never a failure
        return [f"unknown: {type(exc).__name__}: {exc}"]
    return sorted(dtypes)


def _first_lr(optimizer) -> float | None:
    for group in optimizer.param_groups:
        lr = group.get("lr")
        if lr is not None:
            return float(lr)
    return None


# -- driver -------------------------------------------------------------------------------------

def environment() -> dict[str, Any]:
    import torch

    versions: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformer_engine
        versions["transformer_engine"] = transformer_engine.__version__
    except Exception as exc:  # record, don't fail: the run itself will say what TE lacks
        versions["transformer_engine"] = f"unavailable: {type(exc).__name__}: {exc}"
    from megatron.core import package_info
    versions["megatron_core"] = package_info.__version__
    gp = sys.modules.get("gemm_patch")
    versions["gemm_patch"] = getattr(gp, "__version__", None) if gp is not None else None
    versions["gemm_patch_file"] = getattr(gp, "__file__", None) if gp is not None else None
    return {
        "versions": versions,
        "gpu": torch.cuda.get_device_name(),
        "gpus_visible": torch.cuda.device_count(),
        "gemm_patch": gp.status().as_dict() if gp is not None else None,
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                               "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_VISIBLE_DEVICES",
                                               "GEMM_PATCH", "GEMM_PATCH_BACKEND", "GEMM_PATCH_AUTO",
                                               "GEMM_PATCH_TE_OVERWRITE", "GEMM_PATCH_DISABLE")},
    }


def refusal(exc: BaseException) -> dict[str, Any]:
    """A failed run's record: ``unsupported`` holding megatron's (or TE's) own message when the
    exception was raised inside megatron-core or Transformer Engine (megatron refusing the
    layout), else ``error`` (a failure of this script or of the run)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = frames[-1].filename if frames else ""
    message = f"{type(exc).__name__}: {exc}".strip()
    tail = "".join(traceback.format_exception(exc)[-6:])
    own = "/megatron/" in where or "/transformer_engine/" in where
    return {("unsupported" if own else "error"): message, "raised_in": f"{where}:{frames[-1].lineno if frames else 0}",
            "traceback_tail": tail}


def leave_out_targets(names: list[str]) -> None:
    """gemm_patch without these targets: revert, add them to ``GEMM_PATCH_DISABLE`` (comma-separated
    target names), apply again. For a target that shares its switch variable with another
    (moe-te-overwrite shares GEMM_PATCH_TE_OVERWRITE), this is the way to turn it off alone."""
    import megatron.core  # noqa: F401  (under the launcher this imports and applies gemm_patch)

    gp = sys.modules.get("gemm_patch")
    if gp is None:
        raise SystemExit("--leave-out-target needs gemm_patch in the process (gemm-patch run -- torchrun ...)")
    unknown = set(names) - {t.name for t in gp.status().targets}
    if unknown:
        raise SystemExit(f"--leave-out-target: gemm_patch has no target {sorted(unknown)}")
    gp.revert()
    left_out = [n for n in os.environ.get("GEMM_PATCH_DISABLE", "").split(",") if n.strip()]
    os.environ["GEMM_PATCH_DISABLE"] = ",".join(dict.fromkeys([*left_out, *names]))
    gp.apply()


def check_patched() -> None:
    import megatron.core.tensor_parallel.layers  # noqa: F401  (gemm_patch patches on import)
    import torch.distributed as dist

    gp = sys.modules.get("gemm_patch")
    if gp is None:
        raise SystemExit("--require-patch: gemm_patch is not loaded in this process "
                         "(start it with `gemm-patch run -- torchrun ...`)")
    states = {t.name: t.state for t in gp.status().targets}
    if dist.get_rank() == 0:
        print(f"[gemm_patch] targets before the model is built: {states} "
              f"(GEMM_PATCH_TE_OVERWRITE={os.environ.get('GEMM_PATCH_TE_OVERWRITE')!r})", flush=True)
    # 0.1.0: verified/unverified (both patched); 0.2: verified/compatible/forced (unverified is
    # left alone there, and the output layer's fused wgrad then fails with megatron's dtype error).
    if states.get("fsdp-wgrad") not in ("verified", "unverified", "compatible", "forced"):
        raise SystemExit(f"--require-patch: fsdp-wgrad target is {states.get('fsdp-wgrad')!r}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = expand_plan(args)

    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:  # plain `python train_gpt_fsdp.py`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")

    from megatron.core import parallel_state

    sizes = {tuple(int(r.get(k) or 1) for k in PARALLEL_KEYS) for r in runs}
    if len(sizes) != 1:
        raise SystemExit(f"every run of a process needs the same (tp, cp, ep); the plan has {sorted(sizes)}")
    init_parallel(runs[0])
    if args.leave_out_target:
        leave_out_targets(args.leave_out_target)
    if args.require_patch:
        check_patched()
    einops_stand_in = install_mesh_helper_if_no_einops()
    reduce_probe = None
    if args.reduce_probe:  # before any model is wrapped: it observes the buffers' construction
        from validation.probes.ep2_reduce_probe import ReduceProbe

        reduce_probe = ReduceProbe().install()

    results = {
        "schema": "gemm_patch.e2e_run/1",
        "argv": sys.argv,
        "world_size": dist.get_world_size(),
        "einops_stand_in": einops_stand_in,
        **environment(),
        "runs": [],
    }
    for i, run in enumerate(runs):
        try:
            if run["mode"] in ("autograd", "fp64"):
                from validation.parity.autograd_oracle import run_fp64_oracle, run_oracle

                results["runs"].append((run_oracle if run["mode"] == "autograd" else run_fp64_oracle)(run))
                results["runs"][-1].setdefault("gemm_patch_after_wrap", None)
            else:
                if reduce_probe is not None:
                    reduce_probe.set_run(run["name"])
                results["runs"].append(train_one(run, args.untimed_steps, first_in_process=i == 0,
                                                 reduce_probe=reduce_probe))
        except Exception as exc:  # noqa: BLE001 - recorded; the campaign reports it, the next run goes on
            results["runs"].append({"name": run["name"], "config": run, "gemm_patch_after_wrap": None,
                                    **refusal(exc)})
            print(f"[{run['name']}] FAILED: {results['runs'][-1]}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
        if results["runs"][-1]["gemm_patch_after_wrap"] is not None:
            results["gemm_patch_after_wrap"] = results["runs"][-1]["gemm_patch_after_wrap"]
        if dist.get_rank() == 0:  # written after every run: a later crash keeps the earlier ones
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
        if reduce_probe is not None:
            write_reduce_probe(reduce_probe, args.reduce_probe)
    if dist.get_rank() == 0:
        results["gemm_patch"] = environment()["gemm_patch"]  # final state (demotions, if any)
        Path(args.out).write_text(json.dumps(results, indent=1))
    if reduce_probe is not None:
        reduce_probe.uninstall()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


def write_reduce_probe(probe, path: str) -> None:
    """Every rank's probe record, gathered; rank 0 writes them to ``path`` (collective)."""
    import torch.distributed as dist

    from validation.probes.ep2_reduce_probe import dumps

    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, probe.as_dict())
    if dist.get_rank() == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(dumps({"ranks": records}))


if __name__ == "__main__":
    sys.exit(main())
