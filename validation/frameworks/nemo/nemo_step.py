#!/usr/bin/env python
"""The smallest NeMo 2 pretraining run on Megatron-FSDP, one GPU, fusion asked for (NeMo 2.7.3).

fp32 main grads and ``gradient_accumulation_fusion=True``: what NeMo decides about fusion, what
the model's layers do, the losses, and gemm_patch's status.

    python3 -m validation.frameworks.nemo.nemo_step --out /tmp/nemo_plain.json
    GEMM_PATCH_NEMO_FSDP_GAF=1 python3 -m gemm_patch run -- python3 -m validation.frameworks.nemo.nemo_step --out ...
    python3 -m validation.frameworks.nemo.nemo_step --check-imports     # imports only (no GPU needed)

The run: ``llm.GPTConfig`` (2 layers, hidden 256, 4 heads, seq 512, ``gradient_accumulation_fusion``
from ``--fusion``), ``llm.GPTModel`` with NeMo's ``NullTokenizer`` (no vocabulary files: the H200
has no network), NeMo's ``MockDataModule`` (random tokens), ``nl.MegatronStrategy(ddp=<megatron-core
DistributedDataParallelConfig(use_megatron_fsdp=True, grad_reduce_in_fp32=True, ...)>,
fsdp="megatron")`` (NeMo 2.7's Megatron-FSDP switch is ``fsdp="megatron"``; ``ddp="megatron"`` is
plain DDP), ``nl.MegatronMixedPrecision("bf16-mixed", grad_reduce_in_fp32=True)``, Adam with the
distributed optimizer, ``--steps`` steps of ``--global-batch / --micro-batch`` micro-batches, through
NeMo's own ``llm.train`` (``--entry fit``: ``trainer.fit`` directly). No checkpoint, no validation,
no logger.

What it prints (lines starting with ``[nemo_step]``) and writes to ``--out`` (JSON):
- ``nemo_decision``: the model config's ``gradient_accumulation_fusion`` after NeMo's strategy
  setup (``MegatronParallel.init_ddp`` turns it off on its Megatron-FSDP branch unless gemm_patch's
  ``nemo-fsdp-gaf`` target keeps it) and every log record of NeMo (logger ``nemo_logger``) or
  gemm_patch that names ``gradient_accumulation_fusion`` / ``nemo-fsdp-gaf``: NeMo's warning
  "Setting module.config.gradient_accumulation_fusion to False for MCore FSDP." or its absence;
- ``layers``: per layer class, how many have fusion on/off after setup (megatron-core's
  ``ColumnParallelLinear``/``RowParallelLinear`` ``gradient_accumulation_fusion``, Transformer
  Engine's ``fuse_wgrad_accumulation``): the layers keep the value they were built with;
- ``losses`` and ``step_ms`` per step (NeMo's ``reduced_train_loss``), ``main_grad_dtypes``;
- ``gemm_patch_status``: ``str(gemm_patch.status())``, only when gemm_patch is already active
  (``gemm-patch run`` sets GEMM_PATCH_AUTO=1): importing gemm_patch applies it, so a plain run
  must not import it;
- ``grad_dump`` (with ``--grad-dump PATH``): every parameter's full reduced gradient of the first
  step, saved at Lightning's ``on_before_optimizer_step`` (after NeMo's forward-backward and
  megatron's ``finalize_model_grads``, before clipping and the optimizer) with
  validation/parity/gpt_model.py's ``dump_gradients``, in the format compare_grads.py reads;
- ``outcome``: "trained" or "failed" with the exception (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from importlib import metadata
from typing import Any

TAG = "[nemo_step]"
DISTRIBUTIONS = ("nemo-toolkit", "megatron-core", "transformer-engine", "torch", "lightning", "transformers",
                 "huggingface-hub", "tokenizers", "numpy", "gemm-patch")
WATCHED = ("gradient_accumulation_fusion", "nemo-fsdp-gaf")
# the run's sizes: --NAME (default, help)
SIZES = {
    "steps": (3, None), "layers": (2, None), "hidden": (256, None), "heads": (4, None), "seq": (512, None),
    "vocab": (1024, "NullTokenizer vocab size (EOD included)"), "micro-batch": (2, None),
    "global-batch": (4, "4 with --micro-batch 2: 2 micro-batches a step"),
}


def say(*parts: Any) -> None:
    print(TAG, *parts, flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the result here (JSON)")
    for name, (default, text) in SIZES.items():
        p.add_argument(f"--{name}", type=int, default=default, help=text)
    p.add_argument("--fusion", choices=["on", "off"], default="on", help="GPTConfig.gradient_accumulation_fusion")
    p.add_argument("--tied", choices=["on", "off"], default="on",
                   help="GPTConfig.share_embeddings_and_output_weights (NeMo's default: on). megatron-core "
                        "0.14-0.15's Megatron-FSDP hands the tied weight to the output layer through an identity "
                        "autograd Function, and its fused wgrad fails there (tests/megatron/test_shared_weights.py)")
    p.add_argument("--sharding", default="optim_grads_params",
                   help="Megatron-FSDP data_parallel_sharding_strategy")
    p.add_argument("--entry", choices=["train", "fit"], default="train",
                   help="NeMo's llm.train (default) or trainer.fit directly")
    p.add_argument("--log-dir", default="/tmp/nemo_step_logs", help="NeMoLogger's explicit_log_dir")
    p.add_argument("--grad-dump", default=None, metavar="PATH",
                   help="save the first step's full reduced gradients here (validation/parity/compare_grads.py format)")
    p.add_argument("--check-imports", action="store_true",
                   help="import what the run imports, print the versions and exit")
    return p.parse_args(argv)


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


class Watch(logging.Filter):
    """Keeps the log records of NeMo and gemm_patch that are about fusion. A filter on the logger,
    not a handler: gemm_patch installs its own console handler only on a logger that has none."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a record that cannot format itself is not ours to fix
            return True
        if any(w in text for w in WATCHED):
            self.records.append(f"{record.name} {record.levelname}: {text}")
        return True


def gemm_patch_lines() -> list[str] | None:
    """gemm_patch's status, only where it is already active (importing it would apply it)."""
    if os.environ.get("GEMM_PATCH_AUTO") != "1" and "gemm_patch" not in sys.modules:
        return None
    import gemm_patch

    return str(gemm_patch.status()).splitlines()


def fusion_by_layer(root: Any) -> dict[str, dict[str, int]]:
    """Per layer class: how many have fused wgrad on / off (megatron-core's flag or TE's)."""
    counts: dict[str, dict[str, int]] = {}
    for module in root.modules():
        for attribute in ("gradient_accumulation_fusion", "fuse_wgrad_accumulation"):
            value = module.__dict__.get(attribute)  # set in __init__ from the config
            if isinstance(value, bool):
                key = f"{type(module).__name__}.{attribute}"
                counts.setdefault(key, {"on": 0, "off": 0})["on" if value else "off"] += 1
    return counts


def configs_fusion(root: Any) -> list[bool]:
    """The distinct TransformerConfig objects the modules hold, and their fusion setting."""
    seen: dict[int, bool] = {}
    for module in root.modules():
        cfg = module.__dict__.get("config")
        if cfg is not None and hasattr(cfg, "gradient_accumulation_fusion"):
            seen.setdefault(id(cfg), bool(cfg.gradient_accumulation_fusion))
    return list(seen.values())


def build(args: argparse.Namespace):
    """Model, data, trainer and optimizer of the run (NeMo's objects; nothing runs yet)."""
    import dataclasses

    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer
    from nemo.collections.llm.gpt.data.mock import MockDataModule

    tokenizer = NullTokenizer(vocab_size=args.vocab - 1)  # its vocab_size is this + 1 (EOD)
    data = MockDataModule(seq_length=args.seq, tokenizer=tokenizer, micro_batch_size=args.micro_batch,
                          global_batch_size=args.global_batch, num_workers=0, pin_memory=False,
                          num_train_samples=args.steps * args.global_batch * 4)
    config = llm.GPTConfig(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
                           num_attention_heads=args.heads, seq_length=args.seq,
                           gradient_accumulation_fusion=args.fusion == "on",
                           share_embeddings_and_output_weights=args.tied == "on",
                           hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02)
    model = llm.GPTModel(config, tokenizer=tokenizer)
    fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    fp32_fields = {k: torch.float32 for k in ("megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype")
                   if k in fields}  # megatron-core 0.19+; <= 0.17 reads grad_reduce_in_fp32
    ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=args.sharding,
                                        use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                        overlap_grad_reduce=True, overlap_param_gather=True,
                                        check_for_nan_in_grad=True, **fp32_fields)
    strategy = nl.MegatronStrategy(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, ddp=ddp,
                                   fsdp="megatron", save_ckpt_format="fsdp_dtensor", ckpt_async_save=False,
                                   ckpt_load_optimizer=False)
    precision = nl.MegatronMixedPrecision(precision="bf16-mixed", grad_reduce_in_fp32=True)
    optim = nl.MegatronOptimizerModule(config=OptimizerConfig(
        optimizer="adam", lr=1e-4, min_lr=1e-4, weight_decay=0.0, clip_grad=1.0, bf16=True,
        use_distributed_optimizer=True))
    return model, data, strategy, precision, optim


def dump_first_step(trainer: Any, path: str, result: dict[str, Any]) -> None:
    """The first step's full reduced gradients, through gpt_model's reader of Megatron-FSDP's
    gradients (the same reader as the gradient-parity campaigns). A failure is recorded, not
    raised: the run's own outcome stays what NeMo does."""
    try:
        from validation.parity.gpt_model import dump_gradients

        summary = dump_gradients(trainer.strategy.model, path, {"run": "nemo_step", "argv": sys.argv[1:]})
        result["grad_dump"] = {"path": path, "params": summary["params"]}
        say("grad dump:", summary["params"], "parameters ->", path)
    except Exception as exc:  # noqa: BLE001 (recorded in the JSON)
        result["grad_dump"] = {"path": path, "error": f"{type(exc).__name__}: {exc}"}
        say("grad dump FAILED:", result["grad_dump"]["error"])


def make_probe(result: dict[str, Any], grad_dump: str | None = None):
    import lightning.pytorch as pl
    import torch

    class Probe(pl.Callback):
        """Reads NeMo's decision and the layers after setup, the loss and time of each step."""

        def on_train_start(self, trainer, pl_module) -> None:
            root = getattr(trainer.strategy, "model", None)
            root = pl_module if root is None else root
            decided = result["nemo_decision"]["config_fusion_after_setup"] = configs_fusion(root)
            result["layers"] = fusion_by_layer(root)
            result["gemm_patch_status"] = gemm_patch_lines()
            say("after setup: config gradient_accumulation_fusion =", decided)
            for key, count in sorted(result["layers"].items()):
                say(f"  layer {key}: {count['on']} on, {count['off']} off")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if grad_dump and trainer.global_step == 0 and "grad_dump" not in result:
                dump_first_step(trainer, grad_dump, result)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            torch.cuda.synchronize()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            torch.cuda.synchronize()
            ms = (time.perf_counter() - self._t0) * 1e3
            loss = trainer.callback_metrics.get("reduced_train_loss")
            if loss is None and isinstance(outputs, dict):
                loss = outputs.get("loss")
            elif loss is None:
                loss = outputs
            value = float(loss) if loss is not None else None
            result["losses"].append(value)
            result["step_ms"].append(round(ms, 2))
            if not result["main_grad_dtypes"]:
                dtypes: dict[str, int] = {}
                for p in pl_module.parameters():
                    g = getattr(p, "main_grad", None)
                    key = str(g.dtype) if isinstance(g, torch.Tensor) else "none"
                    dtypes[key] = dtypes.get(key, 0) + 1
                result["main_grad_dtypes"] = dtypes
            say(f"step {trainer.global_step}: loss {value} ({ms:.1f} ms)")

    return Probe()


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    from nemo import lightning as nl
    from nemo.collections import llm

    model, data, strategy, precision, optim = build(args)
    trainer = nl.Trainer(devices=1, num_nodes=1, accelerator="gpu", strategy=strategy, plugins=precision,
                         max_steps=args.steps, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
                         enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         callbacks=[make_probe(result, args.grad_dump)])
    if args.entry == "train":
        llm.train(model=model, data=data, trainer=trainer, log=nl.NeMoLogger(explicit_log_dir=args.log_dir),
                  resume=None, optim=optim)
    else:
        optim.connect(model)
        trainer.fit(model, data)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result: dict[str, Any] = {
        "argv": sys.argv[1:], "gemm_patch_run": os.environ.get("GEMM_PATCH_AUTO") == "1",
        "GEMM_PATCH_NEMO_FSDP_GAF": os.environ.get("GEMM_PATCH_NEMO_FSDP_GAF"),
        "outcome": None, "error": None, "versions": {}, "nemo_decision": {"config_fusion_after_setup": None},
        "layers": {}, "losses": [], "step_ms": [], "main_grad_dtypes": {}, "gemm_patch_status": None,
    }
    watch = Watch()
    for name in ("nemo_logger", "gemm_patch"):
        logging.getLogger(name).addFilter(watch)
    code = 0
    try:
        from nemo import lightning as nl  # noqa: F401  (the imports the run needs, in its order)
        from nemo.collections import llm  # noqa: F401
        from nemo.collections.llm.gpt.data.mock import MockDataModule  # noqa: F401

        result["versions"] = versions()
        say("versions:", ", ".join(f"{k} {v}" for k, v in result["versions"].items()))
        if args.check_imports:
            result["outcome"] = "imported"
        else:
            run(args, result)
            result["outcome"] = "trained"
    except BaseException as exc:  # SystemExit too: the JSON says what ended the run
        code = 1
        result["outcome"] = "failed"
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc().splitlines()[-25:]
        say("FAILED:", result["error"])
    result["nemo_decision"]["log"] = watch.records
    if result["gemm_patch_status"] is None:
        result["gemm_patch_status"] = gemm_patch_lines()
    say("NeMo/gemm_patch on fusion:", watch.records or "no record names gradient_accumulation_fusion")
    for line in result["gemm_patch_status"] or ["gemm_patch not active (plain run)"]:
        say("gemm_patch:", line)
    say("losses:", result["losses"], "step_ms:", result["step_ms"], "main_grad:", result["main_grad_dtypes"])
    say("outcome:", result["outcome"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
