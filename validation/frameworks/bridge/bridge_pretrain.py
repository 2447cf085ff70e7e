#!/usr/bin/env python
"""One Megatron-Bridge pretraining run (one process per GPU, under torchrun): Bridge's own entry
point ``pretrain(cfg, forward_step)`` with its ``vanilla_gpt`` recipe, scaled down, on Megatron-FSDP.

    torchrun --nproc_per_node 2 -m validation.frameworks.bridge.bridge_pretrain --out /tmp/br/run1 [--fusion off]
    python -m gemm_patch run -- torchrun --nproc_per_node 2 -m validation.frameworks.bridge.bridge_pretrain ...

What it changes in the recipe: a small model (layers/hidden/heads/seq from the flags), mock data
(``MockGPTDatasetConfig``), Megatron-FSDP ``optim_grads_params`` with the distributed optimizer,
``grad_reduce_in_fp32=True`` and, where megatron-core has the field (0.19+),
``megatron_fsdp_main_grads_dtype=torch.float32`` (Bridge never sets it, so 0.19 would reduce in
bf16 otherwise), a short warm-up, no checkpoint, no evaluation, no TensorBoard. Gradient-accumulation
fusion stays at Bridge's default (``can_enable_gradient_accumulation_fusion()``: on when TE imports)
unless ``--fusion on|off``.

What it records, without changing Bridge's code: ``megatron.bridge.training.train.train_step`` (a
module global that ``train()`` reads at call time) is wrapped to time each step (CUDA-synchronised)
and read its loss dict; at the first step the optimizer's ``step`` is wrapped once so that, after
Bridge's forward/backward and ``finalize_model_grads`` and before the update, every parameter's full
reduced gradient is gathered over the ranks and saved (``validation/parity/train_gpt_fsdp.py``
``dump_gradients``, the format ``validation/parity/compare_grads.py`` reads). Rank 0 writes OUT/result.json;
any exception (also SystemExit) is written to OUT/result.rankR.json with its traceback, then the
process exits 1 so that torchrun ends the other ranks. Both are written atomically (``write_atomic``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for result.json (rank 0) and grads.pt")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--fusion", choices=["default", "on", "off"], default="default")
    p.add_argument("--dump", action="store_true", help="save step 1's full gradients to OUT/grads.pt")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=16, help="16 with mbs 2 on 2 GPUs: 4 micro-batches a step")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def write_atomic(path: Path, text: str) -> None:
    """Write a temp file in the same folder, then ``os.replace``: a rank killed mid-write (torchrun
    SIGTERMs the others when one rank fails) leaves no file or the whole one, never an empty one
    (a 0.6.2 unpatched run killed that way left a 0-byte result.rank0.json)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def build_config(a: argparse.Namespace):
    import torch
    from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config
    from megatron.bridge.training.config import MockGPTDatasetConfig

    cfg = vanilla_gpt_pretrain_config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = a.layers, a.hidden, a.heads
    m.ffn_hidden_size = 4 * a.hidden
    m.seq_length = a.seq
    m.tensor_model_parallel_size = m.pipeline_model_parallel_size = m.context_parallel_size = 1
    if a.fusion != "default":
        m.gradient_accumulation_fusion = a.fusion == "on"
    cfg.train.train_iters = a.iters
    cfg.train.global_batch_size, cfg.train.micro_batch_size = a.gbs, a.mbs
    cfg.validation.eval_interval = a.iters + 1
    cfg.validation.eval_iters = 0
    cfg.dataset = MockGPTDatasetConfig(
        random_seed=a.seed, seq_length=a.seq, reset_attention_mask=False, reset_position_ids=False,
        eod_mask_loss=False, num_dataset_builder_threads=1, data_sharding=True,
        dataloader_type="single", num_workers=0,
    )
    cfg.scheduler.lr_warmup_iters = 2
    cfg.scheduler.lr_decay_iters = a.iters
    if hasattr(cfg.scheduler, "lr_wsd_decay_iters"):
        cfg.scheduler.lr_wsd_decay_iters = None
    d = cfg.ddp
    d.use_megatron_fsdp = True
    d.data_parallel_sharding_strategy = "optim_grads_params"
    d.use_distributed_optimizer = True
    d.average_in_collective = False
    d.grad_reduce_in_fp32 = True
    d.check_for_nan_in_grad = True
    if hasattr(d, "megatron_fsdp_main_grads_dtype"):  # megatron-core 0.19+: Bridge leaves it at bf16
        d.megatron_fsdp_main_grads_dtype = torch.float32
    cfg.dist.use_megatron_fsdp = True
    cfg.optimizer.use_distributed_optimizer = True
    cfg.checkpoint.save = None
    cfg.checkpoint.load = None
    cfg.checkpoint.save_interval = None
    cfg.checkpoint.ckpt_format = "fsdp_dtensor"
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = None
    if hasattr(cfg.logger, "wandb_project"):
        cfg.logger.wandb_project = None
    cfg.rng.seed = a.seed
    return cfg


def scalar(v) -> float | None:
    try:
        import torch

        if isinstance(v, torch.Tensor):
            v = v.detach().float().view(-1)
            return float(v[0] / v[1]) if v.numel() == 2 else float(v.mean())
        return float(v)
    except Exception:  # noqa: BLE001 - a record, never a failure
        return None


def main() -> int:
    a = parse()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    rec: dict = {"argv": sys.argv[1:], "rank": rank, "steps": [], "phase": "import"}
    t0 = time.perf_counter()
    try:
        import megatron.bridge
        import megatron.bridge.training.train as btrain
        import torch
        from megatron.bridge.training.gpt_step import forward_step
        from megatron.bridge.training.pretrain import pretrain

        from validation.parity.gpt_model import dump_gradients

        rec["bridge_version"] = getattr(megatron.bridge, "__version__", None)
        rec["import_s"] = round(time.perf_counter() - t0, 1)
        rec["phase"] = "config"
        cfg = build_config(a)
        rec["gradient_accumulation_fusion_requested"] = cfg.model.gradient_accumulation_fusion
        original_step = btrain.train_step

        def timed_train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
            n = len(rec["steps"]) + 1
            if n == 1:
                rec["phase"] = "step 1"
                rec["gradient_accumulation_fusion_in_model"] = getattr(
                    getattr(model[0], "config", None), "gradient_accumulation_fusion", None)
                if a.dump:
                    inner = optimizer.step

                    def step_with_dump(*s_args, **s_kwargs):
                        optimizer.step = inner  # once
                        torch.cuda.synchronize()
                        rec["dump"] = dump_gradients(model[0], str(out / "grads.pt"),
                                                     {"run": vars(a), "world_size": torch.distributed.get_world_size()})
                        rec["dump"].pop("norms", None)
                        return inner(*s_args, **s_kwargs)

                    optimizer.step = step_with_dump
            torch.cuda.synchronize()
            s = time.perf_counter()
            res = original_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - s) * 1e3
            loss_dict = res[0] if isinstance(res, tuple) and res and isinstance(res[0], dict) else {}
            rec["steps"].append({"step": n, "ms": round(ms, 3),
                                 "loss": {k: scalar(v) for k, v in loss_dict.items()},
                                 "skipped": res[1] if isinstance(res, tuple) and len(res) > 1 else None})
            return res

        btrain.train_step = timed_train_step
        rec["phase"] = "pretrain"
        pretrain(cfg, forward_step)
        rec["phase"] = "done"
        rec["ok"] = True
    except BaseException as e:  # noqa: BLE001 - SystemExit too: Bridge exits on some failures
        if isinstance(e, SystemExit) and e.code in (0, None) and rec["phase"] == "pretrain":
            rec["phase"], rec["ok"] = "done (SystemExit 0)", True
        rec["ok"] = rec.get("ok", False)
        if not rec["ok"]:
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            rec["traceback"] = traceback.format_exc()[-6000:]
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    timed = [s["ms"] for s in rec["steps"][2:]] or [s["ms"] for s in rec["steps"]]
    rec["median_step_ms"] = round(statistics.median(timed), 3) if timed else None
    rec["losses"] = [next(iter(s["loss"].values()), None) for s in rec["steps"]]
    if "gemm_patch" in sys.modules:
        try:
            rec["gemm_patch_status"] = str(sys.modules["gemm_patch"].status())[:3000]
        except Exception as e:  # noqa: BLE001
            rec["gemm_patch_status"] = f"status() raised {e!r}"
    name = "result.json" if rank == 0 and rec["ok"] else f"result.rank{rank}.json"
    write_atomic(out / name, json.dumps(rec, indent=1, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    if not rec["ok"]:
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
