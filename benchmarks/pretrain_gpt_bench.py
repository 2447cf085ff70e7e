#!/usr/bin/env python
"""Step time and memory of Megatron-LM's own pretrain_gpt.py, the user's entry point: fusion off
(megatron as shipped) against fusion on under gemm-patch, tied and untied embeddings, each of
gemm-patch's fixes switched off alone, bf16 main grads; one process at a time on one GPU.

    python -m benchmarks.pretrain_gpt_bench --out OUT/pretrain_gpt.jsonl [--plan core,untied] [--rounds 3]
        [--size hidden4096|hidden2048] [--iters N] [--manual-gc N] [--gc-probe] [--cpus LIST] [--profile START:END]
        [--upstream DIR] [--kit /tmp/gp] [--dry]
    python -m benchmarks.pretrain_gpt_bench --summary OUT/pretrain_gpt.jsonl     # the table, from records
    python -m benchmarks.pretrain_gpt_bench --out OUT/pretrain_gpt.jsonl --plan core --rounds 3 --resume
        # again after a cut-off call: runs only what OUT has no finished record of on this GPU
    python -m benchmarks.pretrain_gpt_bench --compare --out OUT/x --plan core --iters 10 [--kit /tmp/gp]
        # gemm-patch compare on pretrain_gpt.py per (release, tied) of the plan

Model (``--size``): ``hidden4096``: 4 layers, hidden 4096, FFN 16384, 32 heads, sequence 4096,
micro-batch 1, global batch 4 (4 micro-batches), vocabulary 128256; ``hidden2048``: hidden 2048,
FFN 8192, 16 heads, sequence 2048, micro-batch 2, global batch 8, vocabulary 384 (the byte
vocabulary of validation/convergence's speed mode, padded). Megatron-FSDP ``optim_grads_params``,
fp32 main grads, bf16, TE layers, mock data (``--mock-data``), NullTokenizer (``--vocab-size`` is
the vocabulary minus one on 0.15-0.17.x, which adds the end-of-document id, and the vocabulary on
0.19.x; on 0.14-0.15 at least 4095, as their mock data's token ids reach 4095), no evaluation,
``--log-interval 5`` (1 for the Llama shapes; ``--log-interval N``). Megatron prints its memory report after iteration 1
and the next logged one (``report_memory_flag`` in training.py's ``training_log``) and, with
``--log-memory-interval N``, every N iterations: the runs pass N = ``--iters``, so the last report
is after the last iteration (allocated: what lives between steps; max allocated: the peak).
``--manual-gc N`` passes megatron's ``--manual-gc --manual-gc-interval N`` (Python's collector off,
a collection every N iterations, as Megatron-Bridge's recipes set with N = 100): a host-bound step
then no longer carries the collector's pauses, which come at no fixed iteration. ``--cpus LIST``
starts each process under ``taskset -c LIST`` (its threads and workers on those cores only).
``--gc-probe`` runs pretrain_gpt.py under benchmarks/gc_probe.py: the record's ``gc_probe`` says how long
Python's collector held the host in the timed steps (per step, by generation, per logged iteration).
``--strategy`` picks Megatron-FSDP's sharding strategy (default ``optim_grads_params``).
``--profile START:END`` runs megatron's own PyTorch profiler over iterations START to END - 1
(``--profile --use-pytorch-profiler --pytorch-profiler-collect-callstack``) and adds to the record,
as ``profile``, what benchmarks/profile_trace.py reads from the trace: per step the host's wall
time, the GPU's busy time, kernel time by kind, and the time in gemm_patch's own Python frames
(``--no-profile-stacks``: without Python's call stacks, and so without those frames; a smaller trace).
Those are sums of durations, which the host's drift does not move (``--keep-traces`` keeps the trace).

Configurations (``config`` in the records): ``fusion_off`` (``--no-gradient-accumulation-fusion``,
``GEMM_PATCH=0``: megatron alone), ``patched`` (fusion on under ``gemm-patch run``), ``bf16_grads``
(the same with ``--megatron-fsdp-main-grads-dtype bf16``), ``bf16_upstream`` (bf16 main grads fused,
megatron alone: needs apex's wgrad kernel), ``no_<switch>`` (patched with one fix
off: ``GEMM_PATCH_SHARED_GRAD=0``, ``GEMM_PATCH_TE_OVERWRITE=0``, ``GEMM_PATCH_FSDP_DUMMY_GRAD=0``,
``GEMM_PATCH_TE_DUMMY_WGRAD=0``, ``GEMM_PATCH_EMBEDDING_WGRAD=0``), ``fixes_off`` (patched with every
correctness fix off: shared grad, TE overwrite, one-rank scale), ``patched_baseline`` (fusion on under
another version's gemm_patch, the folder ``--baseline-tree`` names, first on the path: a change against
the version before it, in the same rounds on one machine; only where the plan names it, never by ``*``);
tied (pretrain_gpt's default) or untied (``--untie-embeddings-and-output-weights``).

``--plan``: comma-separated cells ``RELEASE:tied|untied:CONFIG`` (``*`` for any) or named sets
(PLANS: ``core``, ``untied``, ``fixes``, ``release-0.17.1``, ``full``, ``alternatives``,
``alternatives-untied``, ``alternatives-0.17.1``). Each round runs every cell
once, the order turned by one each round (so no cell always runs first on a cold GPU). Every
finished process appends one JSON record to ``--out`` at once (entry, release, size, hidden, vocab,
tied, config, round, step_ms: the median of megatron's logged per-iteration times after the
iteration-1 line, allocated_gib and max_allocated_gib of the last memory report, device: the
GPU's name, gpu_clocks: the SM clock, power and temperature while the GPU was busy, and how busy it was in the steps
(benchmarks/gpu_clocks.py, its samples beside the log as NAME.gpu.csv), iterations, rc, error,
command, ...), so a cut-off call keeps what finished; no process starts after
``--deadline`` seconds, and each has ``--proc-limit`` seconds. The GPU kit of
validation/convergence/run.sh is used as there: PYTHONPATH=KIT/mcXYZ:KIT/site:this checkout, the
no-op Makefile in megatron/core/datasets, NCCL_NVLS_ENABLE=0; pretrain_gpt.py and its neighbours
from ``--upstream`` (default validation/convergence/_upstream, one folder per release).
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import pickle
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import gc_probe, gpu_clocks, memory_peak, profile_trace
from gemm_patch.commands.compare import parse_log

ROOT = Path(__file__).resolve().parent.parent

SIZES: dict[str, dict[str, int]] = {
    "hidden4096": {"layers": 4, "hidden": 4096, "ffn": 16384, "heads": 32, "seq": 4096, "mbs": 1, "gbs": 4,
                   "vocab": 128256, "iters": 30},
    "hidden2048": {"layers": 4, "hidden": 2048, "ffn": 8192, "heads": 16, "seq": 2048, "mbs": 2, "gbs": 8,
                   "vocab": 384, "iters": 100},
    # Llama 3.2's shapes at full depth (GQA, SwiGLU, RMSNorm, RoPE base 500000, no biases, no dropout).
    # They log every iteration's time, so a run's rate (steady_step_ms) and any drift within it can be read.
    "llama3.2-1b": {"layers": 16, "hidden": 2048, "ffn": 8192, "heads": 32, "query_groups": 8, "seq": 8192,
                    "mbs": 1, "gbs": 4, "vocab": 128256, "iters": 20, "log_interval": 1},
    # Its weights, fp32 main grads and Adam states (18 bytes a parameter) and its activations do not
    # fit an 80 GB card together: full activation recompute, one layer a block, as a user would run it.
    "llama3.2-3b": {"layers": 28, "hidden": 3072, "ffn": 8192, "heads": 24, "query_groups": 8, "seq": 4096,
                    "mbs": 1, "gbs": 4, "vocab": 128256, "iters": 20, "recompute_layers": 1, "log_interval": 1},
}
LLAMA_ARGS = ["--position-embedding-type", "rope", "--rotary-base", "500000", "--rotary-percent", "1.0",
              "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--disable-bias-linear",
              "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
SWITCHES = {"no_shared_grad": "GEMM_PATCH_SHARED_GRAD", "no_te_overwrite": "GEMM_PATCH_TE_OVERWRITE",
            "no_fsdp_dummy_grad": "GEMM_PATCH_FSDP_DUMMY_GRAD", "no_te_dummy_wgrad": "GEMM_PATCH_TE_DUMMY_WGRAD",
            "no_embedding_wgrad": "GEMM_PATCH_EMBEDDING_WGRAD"}
CONFIGS: dict[str, dict[str, Any]] = {
    "fusion_off": {"env": {"GEMM_PATCH": "0"}, "args": ["--no-gradient-accumulation-fusion"]},
    "patched": {"env": {}, "args": []},
    "bf16_grads": {"env": {}, "args": ["--megatron-fsdp-main-grads-dtype", "bf16"]},
    # Upstream's own fast path, what a user who gives up fp32 gradients runs: megatron alone. Its
    # ColumnParallelLinear refuses fusion without apex's fused_weight_gradient_mlp_cuda, so it runs
    # only where apex is installed; elsewhere bf16_grads is that user's fused path.
    "bf16_upstream": {"env": {"GEMM_PATCH": "0"}, "args": ["--megatron-fsdp-main-grads-dtype", "bf16"]},
    **{config: {"env": {var: "0"}, "args": []} for config, var in SWITCHES.items()},
    # Fusion on under gemm-patch with every correctness fix off (wrong on a tied weight and on
    # persistent buffers): what fusion alone gains, the floor the fixes' cost is measured from.
    "fixes_off": {"env": {"GEMM_PATCH_SHARED_GRAD": "0", "GEMM_PATCH_TE_OVERWRITE": "0",
                          "GEMM_PATCH_ONE_RANK_SCALE": "0"}, "args": []},
    # Fusion on under another version of gemm_patch (--baseline-tree), beside this checkout's in the same
    # rounds: whether a change moved the step, on one machine, rather than between machines.
    "patched_baseline": {"env": {}, "args": []},
}
# Configurations a wildcard in --plan never matches: they need more than the plan (--baseline-tree).
NAMED_ONLY = ("patched_baseline",)


def gemm_patch_tree(config: str, baseline_tree: str | None) -> str | None:
    """The folder whose gemm_patch CONFIG runs in place of this checkout's (patched_baseline), or None."""
    return baseline_tree if config == "patched_baseline" else None
STRATEGIES = ("optim_grads_params", "optim_grads", "optim", "no_shard")
RELEASES = ("0.19.2", "0.17.1")
PLANS = {
    "core": ["0.19.2:tied:fusion_off", "0.19.2:tied:patched"],
    "untied": ["0.19.2:untied:fusion_off", "0.19.2:untied:patched"],
    "fixes": ["0.19.2:tied:bf16_grads", *(f"0.19.2:tied:{c}" for c in SWITCHES), "0.19.2:tied:fixes_off"],
    # What each correctness fix costs: fusion off, every fix, every fix off, each fix off alone.
    "attribution": [f"0.19.2:tied:{c}" for c in ("fusion_off", "patched", "fixes_off", "no_shared_grad",
                                                   "no_te_overwrite", "no_embedding_wgrad")],
    "release-0.17.1": [f"0.17.1:{t}:{c}" for t in ("tied", "untied") for c in ("fusion_off", "patched")],
}
# Every alternative a user has (fusion off, gemm-patch, bf16 main grads fused, every fix off), per
# release and embeddings: "alternatives" (0.19.2 tied), "alternatives-untied", "alternatives-0.17.1".
# The GPU kit has no apex, so bf16 main grads run fused through gemm-patch's stand-in for its kernel.
ALTERNATIVES = ("fusion_off", "patched", "bf16_grads", "fixes_off")
PLANS["alternatives"] = [f"0.19.2:tied:{c}" for c in ALTERNATIVES]
PLANS["alternatives-untied"] = [f"0.19.2:untied:{c}" for c in ALTERNATIVES]
PLANS["alternatives-0.17.1"] = [f"0.17.1:tied:{c}" for c in ALTERNATIVES]
PLANS["full"] = [cell for name in ("core", "untied", "fixes", "release-0.17.1") for cell in PLANS[name]]
LOG_INTERVAL = 5
# Iterations 1-5 hold torch.compile's and the allocator's warm-up (logged every 5, the 2-5 interval is 2-3x a step):
# the steady step is the time of the iterations from this one on over their count, as a run's tokens per second is.
STEADY_FROM = 6
THROUGHPUT_RE = re.compile(r"\biteration\s+\d+/\s*\d+ \|.*?throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)")
SNAPSHOT = "memory_snapshot.pickle"
OLD_MOCK_IDS = 4096  # 0.14-0.15's mock data: token ids below this, whatever the vocabulary
LAUNCHER = "{python} -m torch.distributed.run --standalone --nproc-per-node 1"
GIB = 1024.0


def cells(plan: str) -> list[tuple[str, bool, str]]:
    """(release, tied, config) per cell of the plan, in plan order, each once."""
    every = [(r, t, c) for r in RELEASES for t in ("tied", "untied") for c in CONFIGS]
    out: list[tuple[str, bool, str]] = []
    for item in filter(None, (p.strip() for p in plan.split(","))):
        patterns = PLANS.get(item, [item])
        for pattern in patterns:
            parts = pattern.split(":")
            if len(parts) != 3:
                raise SystemExit(f"--plan: {item!r} is neither a named plan ({', '.join(PLANS)}) nor "
                                 "RELEASE:tied|untied:CONFIG")
            hits = [cell for cell in every if all(fnmatch.fnmatchcase(v, p) for v, p in zip(cell, parts, strict=True))
                    and (cell[2] not in NAMED_ONLY or cell[2] == parts[2])]
            if not hits:
                raise SystemExit(f"--plan: {pattern!r} matches no cell; releases {', '.join(RELEASES)}, "
                                 f"tied or untied, configs {', '.join(CONFIGS)}")
            out += [(r, t == "tied", c) for r, t, c in hits if (r, t == "tied", c) not in out]
    return out


def schedule(plan_cells: list[tuple[str, bool, str]], rounds: int,
             first: int = 1) -> list[tuple[int, tuple[str, bool, str]]]:
    """(round, cell) in run order: round r runs the cells turned by r - 1, so rounds added later to a
    records file (``first`` > 1) keep turning the order where the earlier ones stopped."""
    n = len(plan_cells)
    return [(r, plan_cells[(i + r - 1) % n]) for r in range(first, first + rounds) for i in range(n)]


def pretrain_args(release: str, size: dict[str, int], tied: bool, iters: int,
                  manual_gc: int | None = None, log_interval: int = LOG_INTERVAL,
                  strategy: str = STRATEGIES[0]) -> list[str]:
    vocab = size["vocab"] - 1 if release.startswith(("0.15.", "0.16.", "0.17.")) else size["vocab"]
    # 0.14-0.15 have neither flag: their Megatron-FSDP takes fp32 main grads from --main-grads-dtype
    # (bf16 then accumulates and reduces in fp32), and megatron prints memory after iteration 1 only.
    old = release.startswith(("0.14.", "0.15."))
    if old:  # their mock documents are the ids 1..length-1 (up to 4095), not taken modulo the vocabulary
        vocab = max(vocab, OLD_MOCK_IDS - 1)
    main_grads = ["--main-grads-dtype", "fp32"] if old else ["--megatron-fsdp-main-grads-dtype", "fp32"]
    memory = [] if old else ["--log-memory-interval", iters]
    args = [
        "--num-layers", size["layers"], "--hidden-size", size["hidden"], "--num-attention-heads", size["heads"],
        "--ffn-hidden-size", size["ffn"], "--seq-length", size["seq"], "--max-position-embeddings", size["seq"],
        "--micro-batch-size", size["mbs"], "--global-batch-size", size["gbs"], "--train-iters", iters,
        "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "5",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.02", "--bf16", "--transformer-impl", "transformer_engine",
        "--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy,
        *main_grads, "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", vocab, "--make-vocab-size-divisible-by", "128",
        "--mock-data", "--num-workers", "1", "--eval-iters", "0", "--eval-interval", 100 * iters,
        "--log-interval", log_interval, "--log-throughput", *memory,
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--seed", "1234",
    ]
    if "query_groups" in size:
        args += ["--group-query-attention", "--num-query-groups", size["query_groups"], *LLAMA_ARGS]
    if "recompute_layers" in size:
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", size["recompute_layers"]]
    if manual_gc is not None:
        args += ["--manual-gc", "--manual-gc-interval", manual_gc]
    if not tied:
        args.append("--untie-embeddings-and-output-weights")
    return [str(a) for a in args]


def step_range(text: str) -> tuple[int, int]:
    """--profile's START:END."""
    parts = text.split(":")
    if len(parts) != 2 or not all(x.isdigit() for x in parts) or not 1 < int(parts[0]) < int(parts[1]):
        raise argparse.ArgumentTypeError(f"{text!r}: expected START:END, whole numbers with 1 < START < END")
    return int(parts[0]), int(parts[1])


def profile_args(steps: tuple[int, int] | None, folder: Path, stacks: bool = True) -> list[str]:
    """megatron's PyTorch profiler over iterations START..END-1, with Python's call stacks where STACKS;
    it writes FOLDER/torch_profile/rank-0.json.gz (the parent of its --tensorboard-dir)."""
    if not steps:
        return []
    return ["--profile", "--use-pytorch-profiler", *(["--pytorch-profiler-collect-callstack"] if stacks else []),
            "--profile-step-start", str(steps[0]), "--profile-step-end", str(steps[1]),
            "--tensorboard-dir", str(folder / "tb")]


def process(cell: tuple[str, bool, str], size: dict[str, int], iters: int, opts: argparse.Namespace,
            profile_dir: Path) -> tuple[list[str], dict[str, str], Path]:
    """The command, the environment variables it sets, and its working directory."""
    release, tied, config = cell
    launcher = shlex.split(opts.launcher.format(python=opts.python))
    pin = ["taskset", "-c", opts.cpus] if opts.cpus else []
    probe = ["-m", "benchmarks.gc_probe"] if opts.gc_probe else []
    command = [*pin, opts.python, "-m", "gemm_patch", "run", "--", *launcher, *probe, "pretrain_gpt.py",
               *pretrain_args(release, size, tied, iters, opts.manual_gc, opts.log_interval, opts.strategy),
               *CONFIGS[config]["args"],
               *profile_args(opts.profile, profile_dir, opts.profile_stacks),
               *(["--record-memory-history", "--memory-snapshot-path", str(profile_dir / SNAPSHOT)]
                 if opts.memory_history else [])]
    return command, dict(CONFIGS[config]["env"]), Path(opts.upstream) / release


def environment(release: str, kit: str | None, config_env: dict[str, str],
                tree: str | None = None) -> dict[str, str]:
    """The process's environment: the kit's megatron-core and packages, then TREE's gemm_patch where given
    (patched_baseline), then this checkout's."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GEMM_PATCH") and k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    path = [*([str(Path(tree).resolve())] if tree else []), str(ROOT)]  # the process runs in the release's folder
    if kit:
        path = [f"{kit}/mc{release.replace('.', '')}", f"{kit}/site", *path]
    elif env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env.update(PYTHONPATH=os.pathsep.join(path), NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1", **config_env)
    return env


def prepare_kit(release: str, kit: str | None) -> None:
    """megatron's initialize runs `make` in megatron/core/datasets; the wheel ships the compiled
    helpers without the Makefile: a no-op one lets that step pass (as run.sh does)."""
    if kit:
        datasets = Path(kit) / f"mc{release.replace('.', '')}" / "megatron" / "core" / "datasets"
        if datasets.is_dir() and not (datasets / "Makefile").exists():
            (datasets / "Makefile").write_text("default:\n\t@true\n")


def gpu_name() -> str | None:
    """The GPU's name as nvidia-smi gives it (``NVIDIA H200``): runs on different cards are never
    compared. None where nvidia-smi is missing or fails."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = sorted({line.strip() for line in out.splitlines() if line.strip()})
    return " + ".join(names) or None


def run_one(command: list[str], env: dict[str, str], cwd: Path, log_path: Path, limit: float) -> tuple[int, float]:
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
            log.write(f"\nTIMEOUT: killed after {limit:.0f} s\n")
    return rc, round(time.monotonic() - t0, 1)


def clocks_said(clocks: dict[str, Any] | None) -> str:
    """The progress line's part on the GPU's clock while busy (gpu_clocks), empty where nothing was read."""
    if not clocks or "sm_mhz_median" not in clocks:
        return f" gpu_clocks={clocks}" if clocks else ""
    return (f" SM MHz={clocks['sm_mhz_median']:.0f} (min {clocks['sm_mhz_min']:.0f}"
            f" of {clocks['sm_mhz_rated_max']:.0f})"
            f" W={clocks['power_w_median']:.0f} (max {clocks['power_w_max']:.0f} of {clocks['power_limit_w']:.0f})")


def collector_reading(log_text: str, probe_file: Path) -> dict[str, Any]:
    """gc_probe's reading of a --gc-probe process; where there is none, why (always a non-empty dict:
    the record says the probe ran)."""
    if not probe_file.is_file():
        return {"error": f"{probe_file}: not written (the process did not exit through Python)"}
    read = gc_probe.reading(log_text, probe_file.read_text(errors="replace"))
    return read or {"error": f"{probe_file}: no collections read between two logged iterations"}


def collector_said(reading: dict[str, Any] | None) -> str:
    """The progress line's part on Python's collector (--gc-probe), empty where the probe did not run."""
    if not reading:
        return ""
    if "ms_per_step" not in reading:
        return f" gc_probe={reading}"
    return (f" collector ms/step={reading['ms_per_step']:.1f} (longest {reading['longest_ms']:.1f}, "
            f"full collections {reading['by_generation']['2']['count']})")


def logged_intervals(record: dict[str, Any]) -> list[tuple[int, float]]:
    """(last iteration, per-iteration ms) of each logged line; records made before the iterations were kept
    logged iteration 1 and then every log interval, which is checked against their iteration count."""
    times = record.get("step_ms_intervals") or []
    if record.get("step_ms_iterations"):
        return list(zip(record["step_ms_iterations"], times, strict=True))
    interval = record.get("log_interval", LOG_INTERVAL)
    ends = [1, *range(max(interval, 2), interval * len(times), interval)] if interval > 1 else \
        list(range(1, len(times) + 1))
    return list(zip(ends, times, strict=True)) if times and ends[-1] == record.get("iterations") else []


def steady_step_ms(record: dict[str, Any]) -> float | None:
    """Mean time per iteration from STEADY_FROM on: their logged time over their count (each logged line
    is the mean of the iterations since the previous one). None where no such line was logged."""
    total = count = previous = 0
    for end, ms in logged_intervals(record):
        if previous + 1 >= STEADY_FROM and ms is not None:
            total, count = total + ms * (end - previous), count + end - previous
        previous = end
    return round(total / count, 2) if count else None


def steady_tokens_per_s(record: dict[str, Any]) -> float | None:
    """Tokens per second per GPU over the steady iterations (steady_step_ms) of a named shape's record."""
    step, size = steady_step_ms(record), SIZES.get(record.get("size", ""))
    return size["gbs"] * size["seq"] * 1000.0 / step if step and size else None


def throughput(text: str) -> float | None:
    """Median of megatron's ``--log-throughput`` figures (TFLOP/s per GPU) after the first line."""
    values = [float(v) for v in THROUGHPUT_RE.findall(text)]
    return statistics.median(values[1:] or values) if values else None


def read_snapshot(path: Path | None) -> dict[str, Any] | None:
    """memory_peak's reading of megatron's last memory snapshot (``--memory-history``)."""
    if path is None:
        return None
    try:
        return memory_peak.analyse(memory_peak.load(path))
    except (OSError, EOFError, ValueError, KeyError, pickle.UnpicklingError) as e:
        return {"error": f"{path}: {e}"}


def record(cell: tuple[str, bool, str], rnd: int, size_name: str, iters: int, command: list[str],
           env: dict[str, str], rc: int, seconds: float, log_path: Path,
           manual_gc: int | None = None, trace: Path | None = None, cpus: str | None = None,
           device: str | None = None, strategy: str = STRATEGIES[0],
           snapshot: Path | None = None, log_interval: int = LOG_INTERVAL) -> dict[str, Any]:
    release, tied, config = cell
    profile = None
    if trace is not None:
        try:
            profile = profile_trace.analyse(profile_trace.load(trace))
        except (OSError, EOFError, ValueError, KeyError) as e:  # EOFError: a trace cut off mid-write
            profile = {"error": f"{trace}: {e}"}
    size = SIZES[size_name]
    text = log_path.read_text(errors="replace")
    log = parse_log(text)
    mem = log.last_memory()
    error = log.exception if rc != 0 else None
    if rc == 124:
        error = "timed out (--proc-limit)"
    elif rc != 0 and not error:
        error = f"exit code {rc}"
    elif rc == 0 and not log.iterations:
        error = "no megatron iteration line in the log"
    step_ms = log.step_ms()
    return {
        "entry": "pretrain_gpt", "release": release, "size": size_name, "hidden": size["hidden"],
        "vocab": size["vocab"], "seq": size["seq"], "layers": size["layers"], "micro_batch_size": size["mbs"],
        "global_batch_size": size["gbs"], "strategy": strategy, "tied": tied, "config": config, "round": rnd,
        "step_ms": step_ms, "step_ms_intervals": [it.step_ms for it in log.iterations],
        "step_ms_iterations": [it.iteration for it in log.iterations],
        "tokens_per_s": round(size["gbs"] * size["seq"] * 1000.0 / step_ms, 1) if step_ms else None,
        "tflops": throughput(text), "recompute_layers": size.get("recompute_layers"),
        "memory_history": snapshot is not None, "memory_peak": read_snapshot(snapshot),
        "allocated_gib": round(mem.allocated_mb / GIB, 4) if mem else None,
        "max_allocated_gib": round(mem.max_allocated_mb / GIB, 4) if mem else None,
        "reserved_gib": round(mem.reserved_mb / GIB, 4) if mem else None,
        "memory_after": mem.after if mem else None,
        "iterations": max((it.iteration for it in log.iterations), default=0), "train_iters": iters,
        "log_interval": log_interval,
        "manual_gc_interval": manual_gc, "cpus": cpus, "device": device, "profile": profile,
        "rc": rc, "error": error, "seconds": seconds, "env": env,
        "command": " ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(command)]),
        "gemm_patch_lines": log.gemm_patch_lines, "log": str(log_path),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def compare_runs(a: argparse.Namespace, size: dict[str, int], iters: int, logs: Path) -> int:
    """``gemm-patch compare`` on pretrain_gpt.py for each (release, tied) of the plan, megatron's
    iteration line logged every iteration; its table in OUT's folder/compare_*.txt, its record in
    compare_*.json. Returns the worst exit status (compare's: 0 same, 1 differs, 2 not proven or
    unreadable, 3 not compared)."""
    worst, logs = 0, logs.resolve()  # the command runs in the release's folder
    for release, tied in dict.fromkeys((r, t) for r, t, _ in cells(a.plan)):
        name = f"compare_{a.size}_{release}_{'tied' if tied else 'untied'}"
        launcher = shlex.split(a.launcher.format(python=a.python))
        command = [a.python, "-m", "gemm_patch", "compare", "--iters", str(iters), "--logs", str(logs / name),
                   "--json", str(logs.parent / f"{name}.json"), "--", *launcher, "pretrain_gpt.py",
                   *pretrain_args(release, size, tied, iters, a.manual_gc, strategy=a.strategy), "--log-interval", "1"]
        cwd = Path(a.upstream) / release
        print(f"# {name}\ncd {shlex.quote(str(cwd))} && {shlex.join(command)}", flush=True)
        if a.dry:
            continue
        prepare_kit(release, a.kit)
        logs.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(command, env=environment(release, a.kit, {}), cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=2 * a.proc_limit)
        except subprocess.TimeoutExpired:  # the two runs together: 2 x --proc-limit
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            stderr += f"\ngemm-patch compare: killed after {2 * a.proc_limit:.0f} s (2 x --proc-limit)\n"
        (logs.parent / f"{name}.txt").write_text(stdout + stderr)
        print(stdout + "".join(line + "\n" for line in stderr.splitlines() if line.startswith("gemm-patch compare:")),
              flush=True)
        worst = max(worst, proc.returncode if proc.returncode >= 0 else 2)
    return worst


PAIR_WINDOW_S = 900.0


def finished_s(record: dict[str, Any]) -> float:
    return datetime.datetime.fromisoformat(record["finished"].replace("Z", "+00:00")).timestamp()


DEFAULT_SETTING = "gc auto"
WARM_GAP_S = 60.0


def after_another(record: dict[str, Any], records: list[dict[str, Any]]) -> bool:
    """Whether another of these processes finished on the machine at most WARM_GAP_S before this one
    started: the first process of a run also pays the machine's cold start (kernel caches, the GPU's
    clocks) in its first iteration."""
    if record.get("seconds") is None:
        return False
    end = finished_s(record)
    start = end - record["seconds"]
    # `finished` has whole seconds: one second's slack, and never one that finished with or after this one
    latest = min(start + 1.0, end - 1.0)
    return any(other is not record and start - WARM_GAP_S <= finished_s(other) <= latest for other in records)


def first_iteration(runs: list[dict[str, Any]], reference: list[dict[str, Any]] | None,
                    records: list[dict[str, Any]]) -> str:
    """The median time of iteration 1 (megatron's first logged line) over the processes that ran after
    another, and its difference from the reference's; '-' without such a process."""
    def median_first(rs: list[dict[str, Any]]) -> float | None:
        firsts = [r["step_ms_intervals"][0] for r in rs if r.get("step_ms_intervals") and after_another(r, records)]
        return statistics.median(firsts) if firsts else None
    mine, ref = median_first(runs), median_first(reference or [])
    if mine is None:
        return "-"
    return f"{mine:.1f}" + (f" ({mine - ref:+.1f})" if ref is not None else "")


def setting(record: dict[str, Any]) -> str:
    """What else the process ran under, the GPU and the run's --note among it: runs under different
    settings are never compared."""
    gc, cpus, device = (record.get(k) for k in ("manual_gc_interval", "cpus", "device"))
    strategy = record.get("strategy") or STRATEGIES[0]
    return ((DEFAULT_SETTING if gc is None else f"gc every {gc}") + (f", cpus {cpus}" if cpus else "")
            + (f", {strategy}" if strategy != STRATEGIES[0] else "")
            + (", memory history" if record.get("memory_history") else "")
            + (", profiled" if record.get("profile") else "")
            + (" without call stacks" if record.get("profile") and record.get("profile_stacks") is False else "")
            + (", gc probe" if record.get("gc_probe") else "")
            + (f", log every {interval}" if (interval := record.get("log_interval", LOG_INTERVAL)) != LOG_INTERVAL
               else "")
            + (f", {record['note']}" if record.get("note") else "") + (f", {device}" if device else ""))


def same_round_ratio(runs: list[dict[str, Any]], reference: list[dict[str, Any]] | None) -> str:
    """The median of each run's step time over the reference's of the same round (finished within
    PAIR_WINDOW_S of each other: the machine drifts over hours by more than a fix costs), with the
    number of pairs and their range; '-' without a pair."""
    paired = [r["step_ms"] / o["step_ms"] for r in runs for o in reference or []
              if o["round"] == r["round"] and abs(finished_s(o) - finished_s(r)) <= PAIR_WINDOW_S]
    spread = f": {min(paired):.3f}-{max(paired):.3f}" if len(paired) > 1 else ""
    return f"{statistics.median(paired):.3f} ({len(paired)}{spread})" if paired else "-"


def model(record: dict[str, Any]) -> str:
    """The model's name in tables: its width for the hidden* sizes, the shape's name otherwise."""
    size = record.get("size") or ""
    return size if size in SIZES and not size.startswith("hidden") else str(record["hidden"])


def summary(records: list[dict[str, Any]]) -> str:
    """One line per (size, release, tied, config): median step time over rounds, against fusion
    off of the same model (the ratio of the medians, and the median of the ratios within a round:
    the machine drifts over hours by more than a fix costs, so a pair is a round's two
    processes finished within PAIR_WINDOW_S of each other), and memory against fusion off's."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        if r["rc"] == 0 and r["step_ms"] is not None:
            groups.setdefault((model(r), r["release"], r["tied"], r["config"], setting(r)), []).append(r)
    lines = ["model | release | tied | config | rounds | step ms (median; each round) | vs fusion off | "
             "same round (pairs: range) | vs fixes off, same round | iteration 1 ms, after another process "
             "(- fusion off) | GPU busy / idle ms | allocated GiB | "
             "max allocated GiB | allocated - fusion off | max allocated - fusion off | setting"]
    for key in sorted(groups, key=lambda k: (k[0], k[1], not k[2], not k[4].startswith(DEFAULT_SETTING), k[4],
                                              list(CONFIGS).index(k[3]))):
        rs = sorted(groups[key], key=lambda r: r["round"])
        ms = statistics.median(r["step_ms"] for r in rs)
        off = groups.get((*key[:3], "fusion_off", key[4]))
        ratio = f"{ms / statistics.median(r['step_ms'] for r in off):.3f}" if off else "-"
        same_round = same_round_ratio(rs, off)
        floor = same_round_ratio(rs, groups.get((*key[:3], "fixes_off", key[4])))
        profiled = [r["profile"] for r in rs if isinstance(r.get("profile"), dict) and "gpu_busy_ms" in r["profile"]]
        gpu = (f"{statistics.median(p['gpu_busy_ms'] for p in profiled):.1f} / "
               f"{statistics.median(p['gpu_idle_ms'] for p in profiled):.1f}"
               if profiled and all("gpu_idle_ms" in p for p in profiled) else "-")
        alloc, peak = (max(r[k] for r in rs) for k in ("allocated_gib", "max_allocated_gib"))
        d_alloc = f"{alloc - max(r['allocated_gib'] for r in off):+.3f}" if off else "-"
        d_peak = f"{peak - max(r['max_allocated_gib'] for r in off):+.3f}" if off else "-"
        each = " / ".join(f"{r['step_ms']:.1f}" for r in rs)
        first = first_iteration(rs, off, records)
        lines.append(f"{key[0]} | {key[1]} | {'tied' if key[2] else 'untied'} | {key[3]} | {len(rs)} | {ms:.1f} "
                     f"({each}) | {ratio} | {same_round} | {floor} | {first} | {gpu} | {alloc:.3f} | {peak:.3f} | "
                     f"{d_alloc} | {d_peak} | " + key[4])
    failed = [r for r in records if r["rc"] != 0 or r["step_ms"] is None]
    lines += [f"FAILED {r['release']} {'tied' if r['tied'] else 'untied'} {r['config']} round {r['round']}: "
              f"rc={r['rc']} {r['error']}" for r in failed]
    return "\n".join(lines)


# Nominal memory bandwidth (bytes/s) by the GPU's name: the bound below is an estimate, not a measurement.
BANDWIDTH = {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H200": 4.8e12}



def gemm_weight_params(size: dict[str, int]) -> int:
    """Parameters whose weight gradient is a GEMM that fusion writes into main_grad: every linear
    layer (SwiGLU's first one twice as wide) and the output layer."""
    h, ffn = size["hidden"], size["ffn"]
    kv = size.get("query_groups", size["heads"]) * (h // size["heads"])
    per_layer = h * (h + 2 * kv) + h * h + h * ffn * (2 if "query_groups" in size else 1) + ffn * h
    return size["layers"] * per_layer + size["vocab"] * h


def fusion_saved_bytes(size: dict[str, int]) -> int:
    """Memory traffic a step under gemm-patch does not move, against fusion off: per micro-batch,
    each GEMM weight's bf16 gradient written and read back (4 bytes a parameter), and the embedding
    lookup's dense bf16 gradient (zeroed, read back, and its pass over the fp32 main_grad: 12 bytes
    an entry)."""
    micro = size["gbs"] // size["mbs"]
    return micro * (4 * gemm_weight_params(size) + 12 * size["vocab"] * size["hidden"])


def gpu_busy(records: list[dict[str, Any]]) -> str:
    """The median over these runs of the GPU's mean utilization between the first and last logged
    iteration (gpu_clocks' steps_utilization: the share of the steps' time a kernel ran; the rest the
    GPU waited for the host), with the number of runs read; '-' where none was."""
    busy = [r["gpu_clocks"]["steps_utilization"]["mean_percent"] for r in records
            if isinstance(r.get("gpu_clocks"), dict) and r["gpu_clocks"].get("steps_utilization")]
    return f"{statistics.median(busy):.0f} ({len(busy)})" if busy else "-"


def collector_held(records: list[dict[str, Any]]) -> str:
    """The median over these runs of the time Python's collector held the host per step (--gc-probe's
    reading) and the longest single pause among them, with the number of runs read; '-' where none was."""
    read = [r["gc_probe"] for r in records if isinstance(r.get("gc_probe"), dict) and "ms_per_step" in r["gc_probe"]]
    if not read:
        return "-"
    return (f"{statistics.median(x['ms_per_step'] for x in read):.1f}; longest "
            f"{max(x['longest_ms'] for x in read):.1f} ({len(read)})")


def shape_table(records: list[dict[str, Any]]) -> str:
    """Markdown: per named shape (release, embeddings, setting) and configuration, the medians over
    rounds of the steady step (steady_step_ms: a run's time over its iterations, which a median of
    iterations is not where the step drifts in phases) and its tokens per second (and the rounds'
    range: how far one round says anything), megatron's TFLOP/s per GPU and memory; gemm-patch's
    tokens/s against fusion off, every fix off and bf16 main grads; its gain over fusion off
    beside the bound (fusion_saved_bytes over the GPU's bandwidth); and how busy the GPU was in the
    steps (gpu_busy): a step the GPU waits through is the host's, which fusion does not shorten; and how long
    Python's collector held the host per step where --gc-probe read it (collector_held)."""
    groups: dict[tuple, dict[str, list[dict[str, Any]]]] = {}
    for r in records:
        # A run recording the allocator's history is slowed by it: memory_peak.peak_table reads it.
        if (r["rc"] == 0 and r.get("size") in SIZES and not r["size"].startswith("hidden")
                and not r.get("memory_history") and steady_step_ms(r)):
            key = (r["size"], r["release"], r["tied"], setting(r))
            groups.setdefault(key, {}).setdefault(r["config"], []).append(r)
    rows = ["| shape, megatron-core, embeddings | setting | configuration | rounds | tokens/s per GPU (rounds' range) "
            f"| TFLOP/s per GPU | step ms (iterations {STEADY_FROM}-) | allocated / max allocated GiB "
            "| gemm-patch's tokens/s over this one's "
            "| gain over fusion off: measured / bound (ms; % of step) | GPU busy in the steps (%; runs) "
            "| Python's collector in the steps (ms per step; longest pause ms; runs) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    med = statistics.median
    for (shape, release, tied, where), configs in sorted(groups.items()):
        patched = configs.get("patched")
        for config in sorted(configs, key=lambda c: (ALTERNATIVES + tuple(CONFIGS)).index(c)):
            rs = configs[config]
            each = [steady_tokens_per_s(r) for r in rs]
            tokens, step = med(each), med(steady_step_ms(r) for r in rs)
            flops = [r["tflops"] for r in rs if r.get("tflops") is not None]
            ratio = (f"{med(steady_tokens_per_s(r) for r in patched) / tokens:.3f}"
                     if patched and config != "patched" else "-")
            gain = "-"
            off = configs.get("fusion_off")
            bandwidth = BANDWIDTH.get(rs[0].get("device") or "")
            if config == "patched" and off and bandwidth:
                saved = med(steady_step_ms(r) for r in off) - step
                bound = fusion_saved_bytes(SIZES[shape]) / bandwidth * 1000.0
                gain = f"{saved:.1f} / {bound:.1f} ({100 * saved / step:.1f}% / {100 * bound / step:.1f}%)"
            memory = f"{max(r['allocated_gib'] for r in rs):.2f} / {max(r['max_allocated_gib'] for r in rs):.2f}"
            spread = f" ({min(each):,.0f}-{max(each):,.0f})" if len(rs) > 1 else ""
            rows.append(f"| {shape}, {release}, {'tied' if tied else 'untied'} | {where} | {config} | {len(rs)} | "
                        f"{tokens:,.0f}{spread} | {f'{med(flops):.1f}' if flops else '-'} | {step:.1f} | {memory} | "
                        f"{ratio} | "
                        f"{gain} | {gpu_busy(rs)} | {collector_held(rs)} |")
    return "\n".join(rows) + "\n"


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file this runner wrote (none if it does not exist yet)."""
    if not path.exists():
        return []
    records = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}: line {n} is not a JSON record ({e.msg}): expected the JSONL records "
                             "this runner writes with --out") from None
    return records


def recorded_runs(records: list[dict[str, Any]], a: argparse.Namespace, iters: int,
                  device: str | None) -> set[tuple[int, tuple[str, bool, str]]]:
    """(round, cell) of the finished records made as this run would make them: on this GPU (on any,
    for --dry, which asks no GPU), with the same shape, strategy, iterations, log interval, memory history,
    profiler, collector, CPU pinning, gemm_patch tree and note (a record from before the log interval was recorded
    logged every LOG_INTERVAL): a run of another setting is another row of the tables, never a stand-in for this one."""
    return {(r["round"], (r["release"], r["tied"], r["config"])) for r in records
            if r["rc"] == 0 and r["step_ms"] is not None and r.get("size") == a.size
            and r.get("strategy", STRATEGIES[0]) == a.strategy and r.get("iterations") == iters
            and bool(r.get("memory_history")) == a.memory_history and r.get("note") == a.note
            and bool(r.get("profile")) == bool(a.profile) and bool(r.get("gc_probe")) == a.gc_probe
            and (not a.profile or r.get("profile_stacks", True) == a.profile_stacks)
            and r.get("manual_gc_interval") == a.manual_gc and r.get("cpus") == a.cpus
            and r.get("baseline_tree") == gemm_patch_tree(r["config"], a.baseline_tree)
            and r.get("log_interval", LOG_INTERVAL) == a.log_interval
            and (a.dry or r.get("device") == device)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="JSONL file the records are appended to")
    p.add_argument("--plan", default="core", help="cells or named plans, comma-separated (default: core)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--first-round", type=int, default=1,
                   help="number of the first round (to add rounds to an existing records file)")
    p.add_argument("--size", choices=tuple(SIZES), default="hidden4096")
    p.add_argument("--strategy", choices=STRATEGIES, default=STRATEGIES[0],
                   help=f"Megatron-FSDP's --data-parallel-sharding-strategy (default {STRATEGIES[0]})")
    p.add_argument("--iters", type=int, help="training iterations per process (default: 30 at hidden 4096, "
                   "100 at hidden 2048); a multiple of the log interval")
    p.add_argument("--log-interval", type=int,
                   help=f"megatron's --log-interval (default {LOG_INTERVAL}, 1 for the Llama shapes; 1 logs every "
                        "iteration's time)")
    p.add_argument("--manual-gc", type=int, metavar="N", help="megatron's --manual-gc --manual-gc-interval N "
                   "(default: Python's automatic collector, megatron's default)")
    p.add_argument("--cpus", metavar="LIST", help="run each process under taskset -c LIST (e.g. 0-7)")
    p.add_argument("--profile", type=step_range, metavar="START:END", help="megatron's PyTorch profiler over "
                   "iterations START..END-1; the record gets benchmarks/profile_trace.py's reading of the trace")
    p.add_argument("--profile-stacks", action=argparse.BooleanOptionalAction, default=True,
                   help="with --profile: Python's call stacks in the trace (megatron's "
                        "--pytorch-profiler-collect-callstack; the default); --no-profile-stacks: kernels, host ops "
                        "and the GPU's idle time only, a trace a deep model writes in time")
    p.add_argument("--memory-history", action="store_true",
                   help="megatron's --record-memory-history: the record gets where the step's memory peak falls and "
                        "what is alive there (benchmarks/memory_peak.py); such processes are timed apart")
    p.add_argument("--gc-probe", action="store_true",
                   help="run pretrain_gpt.py under benchmarks/gc_probe.py: the record says how long Python's garbage "
                        "collector held the host in the timed steps")
    p.add_argument("--keep-traces", action="store_true",
                   help="keep the profiler's traces and memory snapshots (tens of MB each)")
    p.add_argument("--upstream", default=str(ROOT / "validation" / "convergence" / "_upstream"),
                   help="folder with one RELEASE/ folder holding pretrain_gpt.py and its neighbours")
    p.add_argument("--kit", default=None, help="the GPU kit's folder (/tmp/gp on the H200): KIT/mcXYZ, KIT/site")
    p.add_argument("--python", default="python3")
    p.add_argument("--launcher", default=LAUNCHER, help=f"what starts pretrain_gpt.py (default: '{LAUNCHER}')")
    p.add_argument("--logs", type=Path, help="per-process logs (default: OUT's folder/logs)")
    p.add_argument("--proc-limit", type=float, default=150.0, help="seconds per process")
    p.add_argument("--deadline", type=float, default=540.0, help="no process starts after this many seconds")
    p.add_argument("--baseline-tree", metavar="DIR",
                   help="another version's gemm_patch for configuration patched_baseline: DIR holds its gemm_patch "
                        "package (git archive COMMIT gemm_patch | tar x -C DIR)")
    p.add_argument("--note", help="a line every record of this run carries (e.g. the gemm_patch commit measured)")
    p.add_argument("--resume", action="store_true",
                   help="skip each (round, cell) --out already holds a finished record of, made on this GPU with the "
                        "same shape, strategy, iterations, log interval, memory history, profiler, collector, CPU "
                        "pinning, gemm_patch tree and --note: the same command run again after a cut-off call "
                        "finishes the plan")
    p.add_argument("--dry", action="store_true", help="print the commands, run nothing")
    p.add_argument("--summary", type=Path, metavar="JSONL", help="print the table of these records and exit")
    p.add_argument("--compare", action="store_true",
                   help="instead: `gemm-patch compare` for each (release, tied) of the plan (--out's folder gets "
                        "compare_*.txt and .json)")
    a = p.parse_args(argv)
    if a.summary:
        records = read_records(a.summary)
        print(summary(records) + "\n\n" + shape_table(records))
        return 0
    size = SIZES[a.size]
    iters = a.iters or size["iters"]
    a.log_interval = a.log_interval or size.get("log_interval", LOG_INTERVAL)
    if a.log_interval < 1:
        p.error(f"--log-interval {a.log_interval}: must be at least 1")
    if iters % a.log_interval:
        p.error(f"--iters {iters}: must be a multiple of --log-interval {a.log_interval} (megatron requires "
                "--log-memory-interval to be a multiple of --log-interval)")
    if not a.profile_stacks and not a.profile:
        p.error("--no-profile-stacks: only with --profile START:END")
    if a.profile and a.profile[1] > iters:
        p.error(f"--profile {a.profile[0]}:{a.profile[1]}: END must be at most --iters ({iters})")
    runs = schedule(cells(a.plan), a.rounds, a.first_round)
    if any(cell[2] == "patched_baseline" for _, cell in runs) and not (
            a.baseline_tree and (Path(a.baseline_tree) / "gemm_patch" / "__init__.py").is_file()):
        p.error(f"--plan names patched_baseline: --baseline-tree {a.baseline_tree or '(not given)'} must be a folder "
                "holding another version's gemm_patch package (DIR/gemm_patch/__init__.py), e.g. from "
                "git archive COMMIT gemm_patch | tar x -C DIR")
    if not a.dry and not a.out:
        p.error("--out is required (or --dry)")
    logs = a.logs or (a.out.parent / "logs" if a.out else Path("logs"))
    if a.compare:
        return compare_runs(a, size, iters, logs)
    t0, done = time.monotonic(), []
    device = None if a.dry else gpu_name()
    recorded = recorded_runs(read_records(a.out), a, iters, device) if a.resume and a.out else set()
    for rnd, cell in runs:
        release, tied, config = cell
        strategy = "" if a.strategy == STRATEGIES[0] else f"_{a.strategy}"
        name = f"{a.size}{strategy}_{release}_{'tied' if tied else 'untied'}_{config}_r{rnd}"
        profile_dir = logs.resolve() / f"{name}_profile"  # the command runs in the release's folder
        command, config_env, cwd = process(cell, size, iters, a, profile_dir)
        probe_file = (logs / f"{name}.gc.json").resolve()
        if a.gc_probe:
            config_env[gc_probe.ENV] = str(probe_file)
        tree = gemm_patch_tree(config, a.baseline_tree)
        shown = " ".join([f"cd {shlex.quote(str(cwd))} &&", *(f"{k}={v}" for k, v in config_env.items()),
                          shlex.join(command)]) + (f"  # gemm_patch from {tree}" if tree else "")
        if (rnd, cell) in recorded:
            print(f"== {name}: recorded in {a.out} already, skipped (--resume)", flush=True)
            continue
        if a.dry:
            print(f"# {name}\n{shown}")
            continue
        if time.monotonic() - t0 > a.deadline:
            print(f"== {name}: skipped, {time.monotonic() - t0:.0f} s > --deadline {a.deadline:.0f}", flush=True)
            continue
        if not (cwd / "pretrain_gpt.py").is_file():
            raise SystemExit(f"{cwd}/pretrain_gpt.py not found: --upstream must hold RELEASE/pretrain_gpt.py "
                             "(validation/convergence/README.md, Reproduce)")
        prepare_kit(release, a.kit)
        logs.mkdir(parents=True, exist_ok=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        if a.memory_history:  # megatron opens the snapshot's path as it is
            profile_dir.mkdir(parents=True, exist_ok=True)
        with gpu_clocks.GpuClocks(logs / f"{name}.gpu.csv") as clocks:
            rc, seconds = run_one(command, environment(release, a.kit, config_env, tree), cwd,
                                  logs / f"{name}.log", a.proc_limit)
        trace = profile_dir / "torch_profile" / "rank-0.json.gz" if a.profile else None
        snapshot = profile_dir / SNAPSHOT if a.memory_history else None
        rec = record(cell, rnd, a.size, iters, command, config_env, rc, seconds, logs / f"{name}.log", a.manual_gc,
                     trace, a.cpus, device, a.strategy, snapshot, a.log_interval)
        log_text = (logs / f"{name}.log").read_text(errors="replace")
        rec["gpu_clocks"] = clocks.summary(log_text)
        rec["baseline_tree"] = tree
        if a.profile:
            rec["profile_stacks"] = a.profile_stacks
        if a.gc_probe:
            rec["gc_probe"] = collector_reading(log_text, probe_file)
        if a.note:
            rec["note"] = a.note
        for kept in (trace, snapshot):
            if kept is not None and not a.keep_traces:
                kept.unlink(missing_ok=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        done.append(rec)
        print(f"== {name}: rc={rc} {seconds:.0f} s step_ms={rec['step_ms']} tokens/s={rec['tokens_per_s']} "
              f"TFLOP/s={rec['tflops']} allocated={rec['allocated_gib']} "
              f"max_allocated={rec['max_allocated_gib']} GiB" + clocks_said(rec["gpu_clocks"])
              + collector_said(rec.get("gc_probe"))
              + (f" error={rec['error']}" if rec["error"] else ""),
              flush=True)
    if done:
        print(summary(done) + "\n\n" + shape_table(done))
    return 0 if all(r["rc"] == 0 and r["step_ms"] is not None for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
