"""The small GPT the parity runs build (megatron-core's GPTModel with TE layers, Megatron-FSDP
configs) and what they share around it: the parameter classes, the synthetic data, the
weights' hash and the gathering and dumping of full gradients across model-parallel ranks.
train_gpt_fsdp.py trains it, autograd_oracle.py takes its gradients without megatron's
wrappers, the framework harnesses (validation/frameworks/) dump theirs the same way.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

PARALLEL_KEYS = ("tp", "cp", "ep")


# Weights whose gradient is written by a fused wgrad GEMM straight into main_grad when
# gradient_accumulation_fusion is on: TE's linear layers, and megatron's ColumnParallelLinear
# output layer (the call site gemm_patch rewrites). Everything else goes through param.grad.
TE_FUSED_SUFFIXES = (".linear_qkv.weight", ".linear_proj.weight", ".linear_fc1.weight",
                     ".linear_fc2.weight", ".eh_proj.weight")


MEGATRON_FUSED_SUFFIXES = ("output_layer.weight",)


def param_kind(name: str) -> str:
    """The parameter's class for the reports (compare_grads.py has the same rule):

    * 'embedding': ``embedding.word_embeddings.weight``. With tied embeddings
      (``--tied on``) it is also the output layer's weight, so with fusion on its gradient is
      the fused output-layer wgrad written into main_grad (once, or twice with MTP) plus every
      embedding lookup's ``param.grad``; untied it is a plain ``param.grad`` weight.
    * 'expert': MoE expert weights (TE grouped linear, fused wgrad).
    * 'megatron-fused': the untied ``output_layer.weight`` (megatron's ColumnParallelLinear).
    * 'te-fused': TE linear layers, the MTP layers' ``eh_proj`` included.
    * 'not-fused': everything else (norms, router, biases).
    """
    if name.endswith("word_embeddings.weight"):
        return "embedding"
    if ".experts." in name and ".weight" in name:
        return "expert"
    if name.endswith(MEGATRON_FUSED_SUFFIXES):
        return "megatron-fused"
    if name.endswith(TE_FUSED_SUFFIXES):
        return "te-fused"
    return "not-fused"


def build_configs(run: dict[str, Any]):
    """TransformerConfig, DistributedDataParallelConfig and OptimizerConfig for one run (no GPU needed)."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    fp32_grads = run["main_grads_dtype"] == "fp32"
    hidden = run["hidden"]
    extra: dict[str, Any] = {}
    extra_ddp: dict[str, Any] = {}
    if run.get("mtp_layers"):
        # 0.16+'s default; 0.15.x defaults to None and divides it (gpt_model.py:574 in 0.15.3).
        extra.update(mtp_num_layers=int(run["mtp_layers"]), mtp_loss_scaling_factor=0.1)
    if run.get("moe_experts"):
        # 4-8 experts top-2 through TE's grouped GEMM (fused wgrad into main_grad like the dense
        # TE layers), a shared expert, alltoall dispatcher, the load-balancing aux loss.
        extra.update(num_moe_experts=int(run["moe_experts"]), moe_router_topk=int(run["moe_topk"]),
                     moe_grouped_gemm=True, moe_ffn_hidden_size=2 * hidden,
                     moe_shared_expert_intermediate_size=2 * hidden,
                     moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
                     moe_aux_loss_coeff=1e-2,
                     # megatron-core refuses biases in shared experts ("bias is not supported in
                     # the shared experts"): no linear biases in MoE models.
                     add_bias_linear=False)
    if run.get("moe_experts") and run.get("moe_fused", "none") != "none":
        # Squared ReLU, the activation of 0.19's fused grouped MLP that runs on sm90
        # (experts.py _is_fused_impl_supported: SwiGLU needs the CuTe DSL kernel). 'on' fuses
        # FC1 + weighted activation + FC2 through TE's op fuser; the router probabilities are
        # applied before FC2 there and after it unfused: the same product (no FC2 bias).
        from megatron.core.activations import squared_relu

        extra.update(activation_func=squared_relu, gated_linear_unit=False)
        if run["moe_fused"] == "on":
            extra.update(use_transformer_engine_op_fuser=True, use_fused_weighted_squared_relu=True)
    if run.get("recompute", "none") == "full":
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    tp, cp, ep = (int(run.get(k) or 1) for k in PARALLEL_KEYS)
    if tp > 1 or cp > 1 or ep > 1:
        extra.update(tensor_model_parallel_size=tp, context_parallel_size=cp, expert_model_parallel_size=ep,
                     sequence_parallel=tp > 1 and run.get("sequence_parallel") == "on")
    if run.get("spec") == "local":  # CPU dry runs: no TE, no fused kernels
        extra.update(use_cpu_initialization=True, apply_rope_fusion=False, bias_activation_fusion=False,
                     masked_softmax_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
                     gradient_accumulation_fusion=False)
    tconfig = TransformerConfig(**{
        "num_layers": run["layers"],
        "hidden_size": hidden,
        "num_attention_heads": max(1, hidden // 64),
        "ffn_hidden_size": 4 * hidden,
        "bf16": True,
        "params_dtype": torch.bfloat16,
        "pipeline_dtype": torch.bfloat16,
        "gradient_accumulation_fusion": run["fusion"] == "on",
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "init_method_std": 0.02,
        **extra,
    })
    if run.get("grad_div_fusion") is not None:
        extra_ddp["gradient_reduce_div_fusion"] = run["grad_div_fusion"] == "on"
    ddp_fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    if run.get("fine_grained_param_gather") is not None:
        field = "megatron_fsdp_enable_fine_grained_param_gather"
        if field not in ddp_fields:
            raise ValueError(f"fine_grained_param_gather: this megatron-core's DistributedDataParallelConfig has "
                             f"no {field} (megatron-core 0.19 and later have it)")
        extra_ddp[field] = run["fine_grained_param_gather"] == "on"
    ddp_config = DistributedDataParallelConfig(
        **extra_ddp,
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=run["sharding"],
        # Megatron-LM requires the distributed optimizer with Megatron-FSDP.
        use_distributed_optimizer=True,
        # MegatronFSDP forces both on for optim_grads_params; for no_shard overlap_grad_reduce
        # makes finish_grad_sync wait for the all-reduce issued in the last micro-batch's
        # backward instead of issuing a second one.
        overlap_grad_reduce=run.get("overlap", "on") == "on",
        overlap_param_gather=run.get("overlap", "on") == "on",
        fsdp_double_buffer=run.get("double_buffer") == "on",
        # fp32: main grads and gradient communication in fp32 (the adapter maps this flag to
        # MixedPrecisionPolicy(main_grads_dtype=fp32, grad_comm_dtype=fp32)).
        # megatron-core <= 0.17 maps grad_reduce_in_fp32 to fp32 main grads; 0.19 no longer does
        # (mcore_fsdp_adapter.py builds the MixedPrecisionPolicy from the megatron_fsdp_* fields
        # alone, and None means "the parameters' dtype", i.e. bf16), so both are set explicitly.
        # (0.15.x has no megatron_fsdp_* fields: grad_reduce_in_fp32 alone decides there.)
        grad_reduce_in_fp32=fp32_grads,
        **{k: torch.float32 if fp32_grads else torch.bfloat16
           for k in ("megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype")
           if k in ddp_fields},
    )
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=run["lr"],
        min_lr=run["lr"],
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=run["adam_beta2"],
        adam_eps=1e-8,
        clip_grad=1.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
    )
    return tconfig, ddp_config, opt_config


def build_gpt(run: dict[str, Any], tconfig):
    """The GPTModel of one run: TE layer spec (or the local one for CPU dry runs), MoE layers
    when ``moe_experts``, an MTP block from ``get_gpt_mtp_block_spec`` when ``mtp_layers``, tied
    or untied embeddings. Call it right after seeding: the initial weights depend only on the
    seed and the shapes (autograd_oracle.py builds the same model this way)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    te = run.get("spec", "te") == "te"
    moe = {"num_experts": int(run["moe_experts"]), "moe_grouped_gemm": True} if run.get("moe_experts") else {}
    layer_spec = (specs.get_gpt_layer_with_transformer_engine_spec if te else specs.get_gpt_layer_local_spec)(**moe)
    mtp_block_spec = None
    if run.get("mtp_layers"):
        mtp_block_spec = specs.get_gpt_mtp_block_spec(tconfig, layer_spec, use_transformer_engine=te)
    return GPTModel(
        config=tconfig,
        transformer_layer_spec=layer_spec,
        vocab_size=run["vocab"],
        max_sequence_length=run["seq"],
        pre_process=True,
        post_process=True,
        parallel_output=True,
        # Untied (the 0.1.0 campaign): the output layer's fused wgrad is the only writer of its
        # main_grad. Tied: the embedding's weight is also the output layer's.
        share_embeddings_and_output_weights=run.get("tied") == "on",
        position_embedding_type=run.get("position_embedding") or "rope",
        mtp_block_spec=mtp_block_spec,
    )


def weights_hash(module) -> str:
    """sha256 of every parameter's bytes, in name order: runs that should start from the same
    initial weights (training configurations and the autograd oracle) record it before any
    wrapping, and the campaign checks they agree."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, param in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        h.update(name.encode())
        t = param.detach().contiguous().cpu()
        h.update(t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes())
    return h.hexdigest()[:16]


class PatternData:
    """Synthetic tokens with a learnable pattern: a fixed random successor map on a fixed
    subset of the vocabulary; each next token follows the map with probability 0.9, else it
    is a uniform draw from the subset. Loss starts near ln(vocab) and falls towards ~1.1 nats.
    Batches depend only on (seed, step), so every configuration sees the same tokens."""

    SUBSET = 1024
    FOLLOW = 0.9

    def __init__(self, vocab: int, seq: int, seed: int) -> None:
        import torch

        self.torch = torch
        self.seq, self.seed = seq, seed
        g = torch.Generator().manual_seed(seed)
        k = min(self.SUBSET, vocab)
        self.subset = torch.randperm(vocab, generator=g)[:k]
        self.successor = self.subset[torch.randperm(k, generator=g)]  # successor of subset[i]
        self.index_of = torch.full((vocab,), -1, dtype=torch.long)
        self.index_of[self.subset] = torch.arange(k)

    def global_batch(self, step: int, sequences: int):
        torch = self.torch
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        k = len(self.subset)
        tokens = torch.empty(sequences, self.seq + 1, dtype=torch.long)
        tokens[:, 0] = self.subset[torch.randint(k, (sequences,), generator=g)]
        follow = torch.rand(sequences, self.seq, generator=g) < self.FOLLOW
        noise = self.subset[torch.randint(k, (sequences, self.seq), generator=g)]
        for t in range(self.seq):
            nxt = self.successor[self.index_of[tokens[:, t]]]
            tokens[:, t + 1] = torch.where(follow[:, t], nxt, noise[:, t])
        return tokens


def strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def full_gradient(param, group_cache: dict | None = None):
    """This parameter's reduced gradient, whole, on every rank (None when it has none).

    After finalize_model_grads Megatron-FSDP has swapped the module's parameters for the
    optimizer's DTensor parameters and set their ``.grad`` to a DTensor view of the reduced
    main-grad buffer (param_and_grad_buffer.py ``update_main_grads``): Replicate for no_shard,
    else Shard(0) over the data-parallel mesh dimension with uneven, row-aligned shards laid out
    in rank order (rank r holds a contiguous slice of the flat buffer). A rank whose shard of a
    parameter is empty has ``.grad = None``, so the layout is read from the parameter."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grad = param.grad if param.grad is not None else getattr(param, "decoupled_grad", None)
    layout = param if isinstance(param, DTensor) else grad
    if not isinstance(layout, DTensor):
        return None if grad is None else grad.detach().float()
    shards = [(dim, p) for dim, p in enumerate(layout.placements) if p.is_shard()]
    shape = tuple(layout.shape)
    if len(layout.placements) == 2:
        # Tensor parallelism: mesh (dp, tp), the TP shard split again over DP (shard order
        # tp first). Undo DP here; the TP shard is returned (unshard_model_parallel gathers it).
        tp_pl = layout.placements[1]
        if tp_pl.is_shard():
            tp_size = layout.device_mesh.size(1)
            shape = tuple(n // tp_size if d == tp_pl.dim else n for d, n in enumerate(shape))
        shards = [(dim, p) for dim, p in shards if dim == 0]
    if grad is not None:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        local = torch.empty((0, *shape[1:]), dtype=torch.float32, device=device)
    local = local.detach().float().reshape(-1, *shape[1:])
    if not shards:
        return local.reshape(shape)
    if len(shards) != 1 or shards[0][1].dim != 0:
        raise RuntimeError(f"unexpected gradient placements {layout.placements}")
    group = layout.device_mesh.get_group(shards[0][0])
    world = dist.get_world_size(group)
    rows = torch.tensor([local.shape[0]], device=local.device)
    all_rows = [torch.zeros_like(rows) for _ in range(world)]
    dist.all_gather(all_rows, rows, group=group)
    counts = [int(r.item()) for r in all_rows]
    if sum(counts) != shape[0]:
        raise RuntimeError(f"shards hold {sum(counts)} rows of {shape[0]}")
    pad = max(counts)
    padded = torch.zeros((pad, *shape[1:]), dtype=torch.float32, device=local.device)
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[:n] for g, n in zip(gathered, counts, strict=True)]).reshape(shape)


# An expert's local index in its name: TEGroupedMLP's ``experts.linear_fc1.weight3``, SequentialMLP's
# ``experts.local_experts.3.``; with expert parallelism rank r holds experts r * local + i.
EXPERT_INDEX = re.compile(r"(\.experts\.(?:linear_fc[12]\.(?:weight|bias)|local_experts\.))(\d+)")


def global_expert_name(name: str, ep_rank: int, num_local: int) -> str:
    return EXPERT_INDEX.sub(lambda m: f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}", name, count=1)


def tp_partition_dim(param) -> int | None:
    """The dimension megatron splits this parameter along over TP ranks (None: replicated)."""
    if getattr(param, "tensor_model_parallel", False) and getattr(param, "partition_dim", -1) >= 0:
        return int(param.partition_dim)
    return None


def unshard_model_parallel(items, num_experts: int) -> dict[str, Any]:
    """``items``: (name, tensor, tp_dim) in the same order on every rank, each tensor whole over
    data parallelism. Returns {name: tensor} whole over TP (shards concatenated along tp_dim, in
    TP-rank order: the TP = 1 layout, megatron's own checkpoint conversion does the same) and
    over expert parallelism (every rank's experts under their global index), on every rank.
    A no-op without TP and EP: the names and shapes of the TP = CP = EP = 1 model either way."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    num_local = num_experts // ep if ep else 0
    out = {}
    for name, t, tp_dim in items:
        expert = EXPERT_INDEX.search(name) is not None
        if tp > 1 and tp_dim is not None and not expert:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
            t = torch.cat(parts, dim=tp_dim)
        if ep > 1 and expert:
            parts = [torch.empty_like(t) for _ in range(ep)]
            dist.all_gather(parts, t.contiguous(), group=parallel_state.get_expert_model_parallel_group())
            out.update((global_expert_name(name, r, num_local), x) for r, x in enumerate(parts))
        else:
            out[name] = t
    return out


def dump_gradients(model, path: str, meta: dict[str, Any], tp_dims: dict[str, int | None] | None = None,
                   num_experts: int = 0) -> dict[str, Any]:
    """Gather every parameter's full reduced gradient; rank 0 saves {name: fp32 CPU tensor}.
    ``tp_dims``: each parameter's TP partition dimension, read before Megatron-FSDP wrapped it."""
    import torch
    import torch.distributed as dist

    items = []
    for name, param in model.named_parameters():
        full = full_gradient(param)
        name = strip_wrappers(name)
        if full is not None:
            items.append((name, full, (tp_dims or {}).get(name)))
    whole = unshard_model_parallel(items, num_experts)
    grads = {n: t.cpu() for n, t in whole.items()} if dist.get_rank() == 0 else {}
    summary = {"path": path, "params": len(grads)}
    if dist.get_rank() == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": "gemm_patch.grad_dump/1", "meta": meta, "grads": grads}, path)
        summary["norms"] = {k: float(v.norm()) for k, v in grads.items()}
    dist.barrier()
    return summary


def init_parallel(run: dict[str, Any]) -> None:
    """megatron's model-parallel state for this run's (tp, cp, ep); pipeline parallelism 1."""
    from megatron.core import parallel_state

    tp, cp, ep = (int(run.get(k) or 1) for k in PARALLEL_KEYS)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                             context_parallel_size=cp, expert_model_parallel_size=ep)
