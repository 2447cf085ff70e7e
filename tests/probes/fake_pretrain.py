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
fusion off's by 1e-6 relative (the accumulation difference); ``FAKE_PRETRAIN`` adds faults
(comma-separated): ``grad_norm`` (the fused grad norm 0.63x, what a lost gradient does), ``silent`` (no megatron
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
noise, a few percent), ``noisy4`` (the same from iteration 4: lm loss by 0.5 %, grad norm by 3 %,
each its own draw), ``unlucky`` (one draw of such noise, fixed: from iteration 4 the fused run
parts from fusion off by 3 % in grad norm and 0.5 % in loss, the perturbed run by a tenth of
that), ``keep_grad`` (the fused run carries its first step's gradient of one parameter into the
second: a defect from iteration 2), ``restart`` (the fused run's worker fails at iteration 3 and
is started again, as ``torchrun --max-restarts 1`` does, with ``TORCHELASTIC_RESTART_COUNT=1``;
it resumes exactly from iteration 3), ``crash_perturbed`` (the perturbed reference run exits 1
after iteration 1), ``shared_fix`` (wherever gemm-patch is active, fusion on or off, the gradient
of ``layer.weight`` is 1.03x: a defect of a fix that runs with fusion off too).
``FAKE_PRETRAIN_LOST_FROM=N`` moves ``lost_later``'s first iteration (default 5).
``FAKE_PRETRAIN_PROBE=1`` writes gradient-probe records through gemm-patch's probe's own writer
where ``GEMM_PATCH_GRAD_PROBE`` is set (at the process's first two steps: three parameters, the
fused ones 1e-6 off, the second step 1e-3 off where ``GEMM_PATCH_GRAD_PROBE_PERTURB`` perturbed
the first), with the fusion setting the model ran with and the iteration, as megatron's arguments
give it (``FAKE_PRETRAIN_PROBE=no_iteration``: not, as under Megatron-Bridge).
``FAKE_PRETRAIN_NO_FIRST_LINE=1`` logs from the first full log interval on, as Megatron-Bridge does.
``FAKE_PRETRAIN_ARGV=FILE`` appends this process's argv and state to FILE (with the file of the gemm_patch
start-up hook that started it).
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


# What gemm-patch's summary lines name where it is active (megatron-core 0.19.2 without apex).
PATCHED_LINES = ("megatron-core 0.19.2: fsdp-wgrad verified, apex-wgrad provided (apex missing; verified), "
                 "fsdp-embedding-wgrad verified",
                 "megatron-core 0.19.2: fsdp-te-overwrite verified, fsdp-shared-grad verified, "
                 "fsdp-one-rank-scale verified")
TARGETS = ("fsdp-wgrad", "apex-wgrad", "fsdp-embedding-wgrad", "fsdp-te-overwrite", "fsdp-shared-grad",
           "fsdp-one-rank-scale")


def write_probe(fused: bool, patched: bool, faults: set[str], iteration: int, call: int) -> None:
    """The gradient probe's record of this process's ``call``-th step, at ``iteration``, written by
    the probe's own writer (gemm_patch/engine/grad_probe.py)."""
    folder = os.environ.get("GEMM_PATCH_GRAD_PROBE")
    if not folder or not os.environ.get("FAKE_PRETRAIN_PROBE"):
        return
    from gemm_patch.engine import grad_probe

    perturbed = float(os.environ.get("GEMM_PATCH_GRAD_PROBE_PERTURB", "0") or 0) > 0
    params = {}
    for i, name in enumerate(("embedding.weight", "layer.weight", "shift")):
        # each iteration's gradient its own: a record paired with another iteration's differs
        norm = (1.0 + i) * (1 + 0.5 * (iteration - 1)) * (1 + 1e-6 * fused)
        norm *= 1 + (1e-3 * (i + 1) if iteration == 2 and perturbed else 0.0)
        if iteration == 2 and fused and "keep_grad" in faults and name == "shift":
            norm *= 1.9  # the first step's gradient still in it
        if patched and "shared_fix" in faults and name == "layer.weight":
            norm *= 1.03
        params[name] = {"numel": 16, "norm": norm, "projections": [norm * (1 if k % 2 else -1) for k in range(8)]}
    enabled = os.environ.get("GEMM_PATCH") != "0"
    known = None if os.environ["FAKE_PRETRAIN_PROBE"] == "no_iteration" else iteration
    grad_probe.write(folder, {
        "schema": grad_probe.SCHEMA, "rank": 0, "parameters": params, "without_gradient": [], "not_recorded": {},
        "blocks": {}, "fusion": [fused],
        "gemm_patch": {"enabled": enabled, "applied": patched,
                       "targets": {name: "verified" if patched else "off" for name in TARGETS}},
        **grad_probe.identity(call, known)})


def main(argv: list[str]) -> int:
    fused = "--no-gradient-accumulation-fusion" not in argv and "model.gradient_accumulation_fusion=false" not in argv
    patched = "_gemm_patch_startup" in sys.modules and os.environ.get("GEMM_PATCH") != "0"
    faults = set(os.environ.get("FAKE_PRETRAIN", "").split(","))
    worker = os.environ.get("FAKE_PRETRAIN_WORKER")
    if "restart" in faults and fused and not worker:
        # torchrun --max-restarts 1: the worker again after it failed, told how often it restarted
        for count in range(2):
            env = {**os.environ, "FAKE_PRETRAIN_WORKER": "1", "TORCHELASTIC_RESTART_COUNT": str(count)}
            rc = subprocess.run([sys.executable, __file__, *argv], env=env).returncode
            if rc == 0:
                break
        return rc
    restarted = worker and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "1"
    run_index = 0  # how many runs FAKE_PRETRAIN_ARGV recorded before this one
    if os.environ.get("FAKE_PRETRAIN_ARGV") and not worker:
        if os.path.exists(os.environ["FAKE_PRETRAIN_ARGV"]):
            with open(os.environ["FAKE_PRETRAIN_ARGV"]) as f:
                run_index = len(f.readlines())
        with open(os.environ["FAKE_PRETRAIN_ARGV"], "a") as f:
            startup = sys.modules.get("_gemm_patch_startup")  # which gemm_patch tree started this process
            f.write(json.dumps({"argv": argv, "fused": fused, "patched": patched,
                                "startup": getattr(startup, "__file__", None),
                                "env": {k: v for k, v in os.environ.items() if k.startswith("GEMM_PATCH")}}) + "\n")
    iters, interval = last_value(argv, "--train-iters", 20), last_value(argv, "--log-interval", 5)
    memory_interval = last_value(argv, "--log-memory-interval", 0)
    print("using world size: 1, data-parallel size: 1", flush=True)
    if "wrapper" in faults:
        fused = True
    if "no_args" not in faults:
        print("------------------------ arguments ------------------------\n"
              f"  global_batch_size ............................... 32\n"
              f"  gradient_accumulation_fusion .................... {fused}\n"
              "-------------------- end of arguments ---------------------", flush=True)
    if "apex" in faults:
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            pass
    elif patched and os.environ.get("GEMM_PATCH_LOG_LEVEL", "INFO").upper() in ("DEBUG", "INFO"):
        for line in PATCHED_LINES:
            print(f"[gemm_patch] INFO: {line}", file=sys.stderr, flush=True)
    if faults & {"sidecar", "hang"}:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        if os.environ.get("FAKE_PRETRAIN_PIDS"):
            with open(os.environ["FAKE_PRETRAIN_PIDS"], "a") as f:
                f.write(f"{os.getpid()} {child.pid}\n")
        if "hang" in faults:
            time.sleep(60)
    if "torchrun" in faults:
        print("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"pretrain_gpt.py\", line 9, in <module>\n"
              "[rank0]: AssertionError: Multi-Token Prediction (MTP) is not supported with learned_absolute\n"
              "Traceback (most recent call last):\n  File \"torchrun\", line 8, in <module>\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              "============================================================\npretrain_gpt.py FAILED", flush=True)
        return 1
    if fused and not patched and not faults & {"apex", "wrapper"}:
        print("RuntimeError: ColumnParallelLinear was called with gradient_accumulation_fusion set to True but "
              "the custom CUDA extension fused_weight_gradient_mlp_cuda module is not found.", flush=True)
        return 1
    if "silent" in faults:
        print("training ... done", flush=True)
        return 0
    if "--use-pytorch-profiler" in argv:
        write_trace(argv, fused)
    extra_mb = 1002.0 if fused and "memory" in faults else 0.0
    noise = __import__("random").Random(os.urandom(8))
    reported = 0
    perturbed = bool(os.environ.get("GEMM_PATCH_GRAD_PROBE_PERTURB"))
    start = 3 if restarted else 1  # the restarted worker resumes from the checkpoint of iteration 2
    for it in range(start, iters + 1):
        if "restart" in faults and worker and not restarted and it == 3:
            print("RuntimeError: NCCL watchdog timeout (the worker fails; torchrun restarts it)", flush=True)
            return 1
        if "crash_perturbed" in faults and perturbed and it == 2:
            print("RuntimeError: CUDA out of memory (the perturbed reference run)", flush=True)
            return 1
        if it < start + 2:  # the probe records a process's first two steps
            write_probe(fused, patched, faults, it, it - start + 1)
        if (it != 1 or os.environ.get("FAKE_PRETRAIN_NO_FIRST_LINE")) and it % interval:
            continue  # FAKE_PRETRAIN_NO_FIRST_LINE: Megatron-Bridge's log, from the first full interval
        # each run parts from the one before by 6 % per 5 iterations, in alternating directions
        drift = 1 + (0.03 * it / 5 * (-1) ** run_index if "drift" in faults and it > 1 else 0.0)
        if "noisy" in faults and it >= 3:
            drift = 1 + 0.02 * noise.gauss(0.0, 1.0)
        loss_noise = (drift - 1) / 10
        if "noisy4" in faults and it >= 4:
            drift, loss_noise = 1 + 0.03 * noise.gauss(0.0, 1.0), 0.005 * noise.gauss(0.0, 1.0)
        if "unlucky" in faults and it >= 4:
            part = 1.0 if fused else 0.1 if perturbed else 0.0
            drift, loss_noise = 1 + 0.03 * part, 0.005 * part
        loss = 5.78 * math.exp(-0.05 * it) * (1 + 1e-6 * fused) * (1 + loss_noise)
        lost_from = int(os.environ.get("FAKE_PRETRAIN_LOST_FROM", "5"))
        lost = fused and ("grad_norm" in faults or ("lost_later" in faults and it >= lost_from))
        grad_norm = 25.7 / it * (0.63 if lost else 1.0) * drift
        if fused and "nan" in faults:
            grad_norm = math.nan
        if fused and "gap" in faults and it == 5:
            continue
        norm_field = "" if fused and "skipped" in faults else f"grad norm: {grad_norm:.3f} | "
        skipped = 1 if fused and "skipped" in faults else 0
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
        if fused and "crash_fused" in faults:
            print("RuntimeError: CUDA error: an illegal memory access was encountered", flush=True)
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
