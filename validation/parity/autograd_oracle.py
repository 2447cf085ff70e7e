"""Second oracle of the layout and tied-weight runs (``autograd``): the weight gradient of step 1 computed without
Megatron-FSDP, to check the fusion-off run (oracle 1) and the patched runs against.

What it runs (one configuration of train_gpt_fsdp.py's ``--plan`` with
``"mode": "autograd"``; the training script imports this module):

* the same model: ``build_gpt`` of the training script with the run's flags (tied embeddings,
  MTP, MoE), gradient-accumulation fusion off, built right after the same seeding as the training
  runs, so its initial weights are the training runs' initial weights (``init_hash``: the
  campaign checks that every run of a layout recorded the same hash). No wrapper but megatron's
  ``Float16Module`` (bf16 compute, fp32 loss, as in training).
* the weights: bf16 model weights, which at step 1 are exactly the fp32 master copy (the
  optimizer's main weights are made from them);
* the same micro-batches: ``PatternData.global_batch(1, dp * M * mbs)``, rank r's
  micro-batch i is rows ``(r * M + i) * mbs ...`` as in training; all ``dp * M`` of them run
  on rank 0, one after another (the other ranks wait at a barrier): nothing is sharded, so
  nothing has to be gathered;
* plain autograd: for each micro-batch ``loss = mean per-token loss / M`` (what megatron's
  schedule backpropagates: ``output_tensor /= num_microbatches``), the MTP and MoE auxiliary
  losses scaled by ``1 / M`` through their ``set_loss_scale`` exactly as the schedule does,
  ``loss.backward()``; then each parameter's ``.grad`` (bf16, the sum of all its uses in that
  backward, as autograd and Megatron-FSDP's fusion-off path both see it) is added in fp32 into
  an accumulator and cleared;
* the reduction: accumulators divided by dp (Megatron-FSDP's ``gradient_scaling_factor`` is
  1/dp; dp = 1 or 2, a power of two, so the division is exact).

Model-parallel layouts (``tp``, ``cp``, ``ep`` > 1): every rank first builds the
layout's own model exactly as training does (same seeding: TP shards and each expert-parallel
rank's experts get their own initial values), and the weights are gathered whole
(``unshard_model_parallel``: TP shards concatenated along their partition dimension, experts
under their global index). Then megatron's parallel state is rebuilt with TP = CP = EP = 1 and
rank 0 runs a replica (the same model without sequence parallelism, which computes the same
products; the MoE path, fused grouped MLP or not, is the run's own: the two paths round
differently in bf16 and a few tokens then route to other experts, 1-10 % per parameter when
the oracle takes the other path) loaded with those weights, as above, with dp = the layout's data-parallel
size for dense weights (micro-batches: TP and CP ranks share theirs, expert-parallel ranks are
data-parallel ranks). CP: the replica sees whole sequences and a per-sequence mean loss; the
training script's CP loss is the rank's token sum over the whole sequence's token count, which
megatron's schedule multiplies by cp and Megatron-FSDP's reduction divides by dp x cp: the same
gradient. Afterwards the layout's parallel state is restored.

The dump has the training script's ``--grad-dump`` format ({name: fp32 CPU tensor}, names
without wrappers), so compare_grads.py compares it like any other dump.
"""

from __future__ import annotations

import time
from typing import Any


def record_step1(result: dict[str, Any], run: dict[str, Any], grads: dict[str, Any], per_rank: list[float],
                 losses: list[float], t0: float) -> None:
    """An oracle's step-1 record: the loss as the training runs log it (mean over micro-batches,
    then over ranks), the micro-batch losses, the dump's path and norms, the seconds it took."""
    result.update(step1_loss=sum(per_rank) / len(per_rank), micro_batch_losses=losses,
                  grad_dump={"path": run["grad_dump"], "params": len(grads),
                             "norms": {n: float(g.norm()) for n, g in grads.items()}},
                  seconds=time.perf_counter() - t0)


def seeded_model(run: dict[str, Any], device: str):
    """(TransformerConfig, GPTModel) of the run with fusion off, built right after the seeding the
    training runs do, so its weights are their initial weights."""
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from validation.parity.gpt_model import build_configs, build_gpt

    tconfig = build_configs({**run, "fusion": "off"})[0]
    torch.manual_seed(run["seed"])
    if device == "cuda":
        model_parallel_cuda_manual_seed(run["seed"])
    return tconfig, build_gpt(run, tconfig).to(device)


def step1_micro_batches(run: dict[str, Any], dp: int, device: str):
    """(inputs, labels, position ids) of step 1's dp x M micro-batches in training order (rank
    r = k // M, its micro-batch k % M)."""
    import torch

    from validation.parity.gpt_model import PatternData

    m, mbs, seq = int(run["micro_batches"]), int(run["micro_batch_size"]), int(run["seq"])
    batch = PatternData(run["vocab"], seq, run["seed"]).global_batch(1, dp * m * mbs)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(mbs, -1)
    for k in range(dp * m):
        tokens = batch[k * mbs:(k + 1) * mbs].to(device)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), position_ids


def run_oracle(run: dict[str, Any], device: str | None = None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from validation.parity.gpt_model import (
        PARALLEL_KEYS,
        build_configs,
        build_gpt,
        init_parallel,
        strip_wrappers,
        tp_partition_dim,
        unshard_model_parallel,
        weights_hash,
    )

    if not run.get("grad_dump"):
        raise SystemExit(f"{run['name']}: mode autograd needs grad_dump")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0
    dp = parallel_state.get_data_parallel_world_size() if dist.is_initialized() else 1
    m = int(run["micro_batches"])
    result: dict[str, Any] = {"name": run["name"], "config": run, "mode": "autograd", "dp": dp,
                              "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    parallel = any(int(run.get(k) or 1) > 1 for k in PARALLEL_KEYS)
    weights = None
    if parallel:
        tconfig = build_configs({**run, "fusion": "off"})[0]
        torch.manual_seed(run["seed"])
        model_parallel_cuda_manual_seed(run["seed"])
        layout_gpt = build_gpt(run, tconfig).to(device)
        result["init_hash"] = weights_hash(layout_gpt)  # rank 0's shard, as the training runs record it
        weights = unshard_model_parallel(
            [(n, p.detach(), tp_partition_dim(p)) for n, p in layout_gpt.named_parameters()],
            int(run.get("moe_experts") or 0))
        del layout_gpt
        parallel_state.destroy_model_parallel()
        init_parallel({})  # TP = CP = EP = 1 for the replica
        run = {**run, **{k: 1 for k in PARALLEL_KEYS}, "sequence_parallel": "off"}
        result["replica"] = {k: run[k] for k in (*PARALLEL_KEYS, "sequence_parallel", "moe_fused")}
    if rank == 0:
        t0 = time.perf_counter()
        tconfig, gpt = seeded_model(run, device)
        if weights is not None:
            own = dict(gpt.named_parameters())
            bad = sorted(set(own) ^ set(weights)) or [
                (n, tuple(p.shape), tuple(weights[n].shape)) for n, p in own.items() if p.shape != weights[n].shape]
            if bad:
                raise RuntimeError(f"the replica's parameters and the gathered weights differ: {bad[:6]}")
            with torch.no_grad():
                for n, p in own.items():
                    p.copy_(weights[n])
        else:
            result["init_hash"] = weights_hash(gpt)
        model = Float16Module(tconfig, gpt)
        params = {strip_wrappers(n): p for n, p in model.named_parameters() if p.requires_grad}
        acc = {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for n, p in params.items()}

        scale = torch.ones(1, device=device) / m
        losses = []
        for inputs, labels, position_ids in step1_micro_batches(run, dp, device):
            output = model(inputs, position_ids, None, labels=labels)
            loss = output.float().mean()
            losses.append(float(loss))
            if getattr(tconfig, "mtp_num_layers", None):
                from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
                MTPLossAutoScaler.set_loss_scale(scale)
            if getattr(tconfig, "num_moe_experts", None):
                from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
                MoEAuxLossAutoScaler.set_loss_scale(scale)
            (loss / m).backward()
            for n, p in params.items():
                if p.grad is not None:
                    acc[n].add_(p.grad.float())
                    p.grad = None
        grads = {n: (a / dp).cpu() for n, a in acc.items()}
        from pathlib import Path
        Path(run["grad_dump"]).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": "gemm_patch.grad_dump/1", "meta": {"run": run, "oracle": "autograd", "dp": dp},
                    "grads": grads}, run["grad_dump"])
        # Step 1's loss as the training runs log it: mean over micro-batches, then over ranks.
        per_rank = [sum(losses[r * m:(r + 1) * m]) / m for r in range(dp)]
        record_step1(result, run, grads, per_rank, losses, t0)
        del model, gpt, params, acc, grads
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"[{run['name']}] autograd oracle: {dp * m} micro-batches, step-1 loss {result['step1_loss']:.5f}, "
              f"{result['grad_dump']['params']} params, init {result['init_hash']}, {result['seconds']:.1f} s",
              flush=True)
    if dist.is_initialized():
        dist.barrier()
    if parallel:
        del weights
        parallel_state.destroy_model_parallel()
        init_parallel(result["config"])  # the layout's state again, for the runs after this one
    return result


# -- the fp64 oracle ------------------------------------------------------------------------------
#
# ``"mode": "fp64"``: step 1's gradient of the same dense model in float64, the truth both
# fusion off and the fused fp32 path approximate. TE computes in bf16/fp16/fp32 only, so the
# model is rebuilt with megatron's local layer spec (plain torch: ColumnParallelLinear /
# RowParallelLinear, DotProductAttention with an explicit causal mask, torch LayerNorm) in
# float64, and loaded with the TE model's initial weights, bf16 values exactly. The two specs
# compute the same function: TE fuses each block's first LayerNorm into the linear layer after it
# (TE_TO_LOCAL renames those two parameters), everything else has the same name and shape.
# Megatron's cross entropy upcasts the logits to fp32 (vocab_parallel_cross_entropy), a relative
# error of about 1e-7 in the loss gradient, far below the bf16 rounding (2^-9) this oracle judges.

TE_TO_LOCAL = ((".self_attention.linear_qkv.layer_norm_", ".input_layernorm."),
               (".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."))


def local_name(name: str) -> str:
    """A TE-spec parameter name as megatron's local layer spec names the same parameter."""
    for te, local in TE_TO_LOCAL:
        if te in name:
            return name.replace(te, local)
    return name


def with_torch_norms(model, tconfig) -> None:
    """Swap each of TE's LayerNorm modules in ``model`` for torch's, same weights and epsilon:
    with TE installed megatron-core 0.17-0.19 build the block's final norm from TE even under the
    local layer spec, and TE has no float64 kernels (``KeyError: torch.float64`` in its
    layer_norm op)."""
    import torch

    assert not tconfig.layernorm_zero_centered_gamma, "torch's LayerNorm has no zero-centred gamma"
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "LayerNorm" and type(child).__module__.startswith("transformer_engine"):
                weight = child.weight
                norm = torch.nn.LayerNorm(weight.shape[0], eps=tconfig.layernorm_epsilon, device=weight.device,
                                          dtype=weight.dtype)
                with torch.no_grad():
                    norm.weight.copy_(weight)
                    norm.bias.copy_(child.bias)
                setattr(parent, name, norm)


def dense_gradients(run: dict[str, Any], weights: dict[str, Any], dtype, device: str, dp: int = 1):
    """Step 1's gradient ({name as in ``weights``: tensor of ``dtype``}) and the micro-batch losses
    of the run's dense model built with the local layer spec in ``dtype``, every parameter loaded
    from ``weights`` (either spec's names). Each micro-batch's loss / M is backpropagated and the
    gradients summed in ``dtype``, then divided by dp (megatron's schedule and reduction)."""
    import dataclasses

    import torch

    from validation.parity.gpt_model import build_configs, build_gpt

    local_run = {**run, "fusion": "off", "spec": "local"}
    tconfig = dataclasses.replace(build_configs(local_run)[0], bf16=False, params_dtype=dtype, pipeline_dtype=dtype)
    gpt = build_gpt(local_run, tconfig).to(device=device, dtype=dtype)
    with_torch_norms(gpt, tconfig)
    own = dict(gpt.named_parameters())
    source = {local_name(n): n for n in weights}
    if set(source) != set(own) or any(own[n].shape != weights[source[n]].shape for n in own):
        raise RuntimeError(f"the local-spec model's parameters and the weights differ: "
                           f"{sorted(set(source) ^ set(own))[:6]}")
    with torch.no_grad():
        for n, p in own.items():
            p.copy_(weights[source[n]].to(device=device, dtype=dtype))
    seq, m = int(run["seq"]), int(run["micro_batches"])
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    acc = {n: torch.zeros_like(p) for n, p in own.items()}
    losses = []
    for inputs, labels, position_ids in step1_micro_batches(run, dp, device):
        loss = gpt(inputs, position_ids, causal, labels=labels).to(dtype).mean()
        losses.append(float(loss.detach()))
        (loss / m).backward()
        for n, p in own.items():
            if p.grad is not None:
                acc[n].add_(p.grad)
                p.grad = None
    return {source[n]: (a / dp).cpu() for n, a in acc.items()}, losses


def run_fp64_oracle(run: dict[str, Any], device: str | None = None) -> dict[str, Any]:
    """The fp64 oracle of a dense run without model parallelism (rank 0; the others wait): the
    run's own model (TE spec) built as training builds it, then ``dense_gradients`` in float64;
    the dump in the --grad-dump format with float64 tensors."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from validation.parity.gpt_model import PARALLEL_KEYS, weights_hash

    if not run.get("grad_dump"):
        raise SystemExit(f"{run['name']}: mode fp64 needs grad_dump")
    if any(int(run.get(k) or 1) > 1 for k in PARALLEL_KEYS) or run.get("moe_experts") or run.get("mtp_layers"):
        raise SystemExit(f"{run['name']}: mode fp64 is for a dense model without model parallelism or MTP")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0
    dp = parallel_state.get_data_parallel_world_size() if dist.is_initialized() else 1
    result: dict[str, Any] = {"name": run["name"], "config": run, "mode": "fp64", "dp": dp}
    if rank == 0:
        t0 = time.perf_counter()
        _, gpt = seeded_model(run, device)
        result["init_hash"] = weights_hash(gpt)
        weights = {n: p.detach().clone() for n, p in gpt.named_parameters()}
        del gpt
        grads, losses = dense_gradients(run, weights, torch.float64, device, dp)
        from pathlib import Path
        Path(run["grad_dump"]).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": "gemm_patch.grad_dump/1", "meta": {"run": run, "oracle": "fp64", "dp": dp},
                    "grads": grads}, run["grad_dump"])
        m = int(run["micro_batches"])
        per_rank = [sum(losses[r * m:(r + 1) * m]) / m for r in range(dp)]
        record_step1(result, run, grads, per_rank, losses, t0)
        del weights, grads
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"[{run['name']}] fp64 oracle: {dp * m} micro-batches, step-1 loss {result['step1_loss']:.6f}, "
              f"{result['grad_dump']['params']} params, init {result['init_hash']}, {result['seconds']:.1f} s",
              flush=True)
    if dist.is_initialized():
        dist.barrier()
    return result
