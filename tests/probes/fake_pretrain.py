"""A stand-in for Megatron-LM's pretrain_gpt.py in tests of `gemm-patch compare` and the
benchmark runner: prints megatron's iteration lines and memory report (the format of
megatron-core 0.17.1-0.19.2's training_log and report_memory) for ``--train-iters`` iterations
(the last occurrence wins, as with argparse) every ``--log-interval``; the memory report after the
first two logged iterations and every ``--log-memory-interval``.

Its numbers depend on what the real thing's depend on: whether fusion is off
(``--no-gradient-accumulation-fusion`` or the override ``model.gradient_accumulation_fusion=false``)
and, with fusion on, whether gemm-patch's start-up hook is active in this process
(``gemm-patch run`` installs it; ``GEMM_PATCH=0`` turns gemm-patch off). Fusion on without
gemm-patch stops as megatron does without apex. With fusion on, the loss and grad norm differ from
fusion off's by 1e-6 relative (the accumulation difference); ``FAKE_PRETRAIN`` adds a fault:
``grad_norm`` (the fused grad norm 0.63x, what a lost gradient does), ``silent`` (no megatron
lines), ``crash_fused`` (the fused run exits 3 after iteration 1), ``memory`` (the fused run
holds 1002 MB more), ``nan`` (the fused run's grad norm is nan), ``skipped`` (every fused step
skipped by the fp16 loss scaler: no grad norm), ``gap`` (the fused run does not log iteration 5),
``wrapper`` (a wrapper that drops an unknown --no-gradient-accumulation-fusion: fusion stays on,
and runs without gemm-patch, as with apex installed),
``no_args`` (no argument dump), ``torchrun`` (a worker's traceback, then torchrun's
ChildFailedError block, exit 1), ``sidecar`` (leaves a child holding the output for a minute),
``hang`` (a child and this process sleep until ended: FAKE_PRETRAIN_PIDS=FILE gets their pids),
``drift`` (after iteration 1 each run parts from the one before, fusion off from itself too, by
a few percent, as with a non-deterministic MoE router; needs FAKE_PRETRAIN_ARGV, which counts the runs),
``lost_later`` (the fused grad norm 0.63x from iteration 5 on), ``apex`` (fusion runs without
gemm-patch, as with apex installed; imports ``megatron.core`` where one is importable, which starts
gemm-patch's real start-up hook, and prints no line of its own).
Like megatron it prints its arguments (``gradient_accumulation_fusion ...
True``) and, where gemm-patch's start-up hook is active, gemm-patch's line (the real one needs a
megatron import; tests/probes/megatron_pretrain.py runs megatron's real layers instead).
``noisy`` (from iteration 3 every run, fusion off too, parts from the others by its own random
noise, a few percent), ``keep_grad`` (the fused run carries its first step's gradient of one
parameter into the second: a defect from iteration 2).
``FAKE_PRETRAIN_PROBE=1`` writes gradient-probe records as gemm-patch's probe does where
``GEMM_PATCH_GRAD_PROBE`` is set (after steps 1 and 2: three parameters, the fused ones 1e-6 off,
the second step 1e-3 off where ``GEMM_PATCH_GRAD_PROBE_PERTURB`` perturbed the first), with the
fusion setting the model ran with. ``FAKE_PRETRAIN_NO_FIRST_LINE=1`` logs from the first full
log interval on, as Megatron-Bridge does.
``FAKE_PRETRAIN_ARGV=FILE`` appends this process's argv and state to FILE.
With megatron's ``--use-pytorch-profiler``, it writes a profiler trace where megatron does (the
parent of ``--tensorboard-dir``/torch_profile/rank-0.json.gz): a ``ProfilerStep#N`` range per
profiled iteration, each with one GEMM kernel of 120 us fusion off, 100 us fused.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path


def last_value(argv: list[str], flag: str, default: int) -> int:
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    return int(values[-1]) if values else default


def write_trace(argv: list[str], fused: bool) -> None:
    start, end = last_value(argv, "--profile-step-start", 10), last_value(argv, "--profile-step-end", 12)
    folder = Path(argv[argv.index("--tensorboard-dir") + 1]).parent / "torch_profile"
    folder.mkdir(parents=True, exist_ok=True)
    events = []
    for i, step in enumerate(range(start, end)):
        t0 = 1000.0 * i
        events += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                    "ts": t0, "dur": 900.0},
                   {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "pid": 0,
                    "tid": 7, "ts": t0 + 50.0, "dur": 100.0 if fused else 120.0}]
    with gzip.open(folder / "rank-0.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def write_probe(fused: bool, patched: bool, fault: str) -> None:
    """The gradient probe's records of steps 1 and 2 (gemm_patch/engine/grad_probe.py's format)."""
    folder = os.environ.get("GEMM_PATCH_GRAD_PROBE")
    if not folder or not os.environ.get("FAKE_PRETRAIN_PROBE"):
        return
    perturbed = float(os.environ.get("GEMM_PATCH_GRAD_PROBE_PERTURB", "0") or 0) > 0
    for step, where in ((1, folder), (2, os.path.join(folder, "step2"))):
        params = {}
        for i, name in enumerate(("embedding.weight", "layer.weight", "shift")):
            norm = (1.0 + i) * (1 + 1e-6 * fused) * (1 + (1e-3 * (i + 1) if step == 2 and perturbed else 0.0))
            if step == 2 and fused and fault == "keep_grad" and name == "shift":
                norm *= 1.9  # the first step's gradient still in it
            params[name] = {"numel": 16, "norm": norm, "projections": [norm * (1 if k % 2 else -1) for k in range(8)]}
        Path(where).mkdir(parents=True, exist_ok=True)
        Path(where, "rank0.json").write_text(json.dumps({
            "schema": 1, "rank": 0, "parameters": params, "without_gradient": [], "not_recorded": {}, "blocks": {},
            "fusion": [fused], "gemm_patch": {"enabled": os.environ.get("GEMM_PATCH") != "0", "applied": patched}}))


def main(argv: list[str]) -> int:
    fused = "--no-gradient-accumulation-fusion" not in argv and "model.gradient_accumulation_fusion=false" not in argv
    patched = "_gemm_patch_startup" in sys.modules and os.environ.get("GEMM_PATCH") != "0"
    fault = os.environ.get("FAKE_PRETRAIN", "")
    run_index = 0  # how many runs FAKE_PRETRAIN_ARGV recorded before this one
    if os.environ.get("FAKE_PRETRAIN_ARGV"):
        if os.path.exists(os.environ["FAKE_PRETRAIN_ARGV"]):
            with open(os.environ["FAKE_PRETRAIN_ARGV"]) as f:
                run_index = len(f.readlines())
        with open(os.environ["FAKE_PRETRAIN_ARGV"], "a") as f:
            f.write(json.dumps({"argv": argv, "fused": fused, "patched": patched,
                                "env": {k: v for k, v in os.environ.items() if k.startswith("GEMM_PATCH")}}) + "\n")
    iters, interval = last_value(argv, "--train-iters", 20), last_value(argv, "--log-interval", 5)
    memory_interval = last_value(argv, "--log-memory-interval", 0)
    print("using world size: 1, data-parallel size: 1", flush=True)
    if fault == "wrapper":
        fused = True
    if fault != "no_args":
        print("------------------------ arguments ------------------------\n"
              f"  global_batch_size ............................... 32\n"
              f"  gradient_accumulation_fusion .................... {fused}\n"
              "-------------------- end of arguments ---------------------", flush=True)
    if fault == "apex":
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            pass
    elif patched:
        print("[gemm_patch] INFO: megatron-core 0.19.2: fsdp-wgrad verified, apex-wgrad provided (apex missing; "
              "verified)", file=sys.stderr, flush=True)
    if fault in ("sidecar", "hang"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        if os.environ.get("FAKE_PRETRAIN_PIDS"):
            with open(os.environ["FAKE_PRETRAIN_PIDS"], "a") as f:
                f.write(f"{os.getpid()} {child.pid}\n")
        if fault == "hang":
            time.sleep(60)
    if fault == "torchrun":
        print("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"pretrain_gpt.py\", line 9, in <module>\n"
              "[rank0]: AssertionError: Multi-Token Prediction (MTP) is not supported with learned_absolute\n"
              "Traceback (most recent call last):\n  File \"torchrun\", line 8, in <module>\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              "============================================================\npretrain_gpt.py FAILED", flush=True)
        return 1
    if fused and not patched and fault not in ("apex", "wrapper"):
        print("RuntimeError: ColumnParallelLinear was called with gradient_accumulation_fusion set to True but "
              "the custom CUDA extension fused_weight_gradient_mlp_cuda module is not found.", flush=True)
        return 1
    if fault == "silent":
        print("training ... done", flush=True)
        return 0
    if "--use-pytorch-profiler" in argv:
        write_trace(argv, fused)
    write_probe(fused, patched, fault)
    extra_mb = 1002.0 if fused and fault == "memory" else 0.0
    noise = __import__("random").Random(os.urandom(8))
    reported = 0
    for it in range(1, iters + 1):
        if (it != 1 or os.environ.get("FAKE_PRETRAIN_NO_FIRST_LINE")) and it % interval:
            continue  # FAKE_PRETRAIN_NO_FIRST_LINE: Megatron-Bridge's log, from the first full interval
        # each run parts from the one before by 6 % per 5 iterations, in alternating directions
        drift = 1 + (0.03 * it / 5 * (-1) ** run_index if fault == "drift" and it > 1 else 0.0)
        if fault == "noisy" and it >= 3:
            drift = 1 + 0.02 * noise.gauss(0.0, 1.0)
        loss = 5.78 * math.exp(-0.05 * it) * (1 + 1e-6 * fused) * (1 + (drift - 1) / 10)
        lost = fused and (fault == "grad_norm" or (fault == "lost_later" and it >= 5))
        grad_norm = 25.7 / it * (0.63 if lost else 1.0) * drift
        if fused and fault == "nan":
            grad_norm = math.nan
        if fused and fault == "gap" and it == 5:
            continue
        norm_field = "" if fused and fault == "skipped" else f"grad norm: {grad_norm:.3f} | "
        skipped = 1 if fused and fault == "skipped" else 0
        ms = (5918.5 if it == 1 else 300.0 + (it % 3)) - (5.0 if fused else 0.0)
        print(f" [2026-12-01 15:40:28.567484] iteration {it:8d}/{iters:8d} | consumed samples: {32 * it:12d} | "
              f"elapsed time per iteration (ms): {ms:.1f} | learning rate: 2.000000E-04 | global batch size:    32 | "
              f"lm loss: {loss:.6E} | loss scale: 1.0 | {norm_field}num zeros: 0 | "
              f"number of skipped iterations: {skipped:3d} | number of nan iterations:   0 |", flush=True)
        if reported < 2 or (memory_interval and it % memory_interval == 0):
            reported += 1
            print(f"[Rank 0] (after {it} iterations) memory (MB) | allocated: {323.11 + extra_mb:.2f} | max allocated: "
                  f"{578.22 + 101.71 * min(reported - 1, 1) + extra_mb:.2f} | reserved: 668.00 | max reserved: 668.00",
                  flush=True)
        if fused and fault == "crash_fused":
            print("RuntimeError: CUDA error: an illegal memory access was encountered", flush=True)
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
