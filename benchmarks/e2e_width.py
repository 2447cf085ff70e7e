#!/usr/bin/env python
"""The width benchmark: Megatron-FSDP GPT at realistic width on 1 and 2 GPUs, three
configurations, one torchrun process per (configuration, round), rounds interleaved.

    python benchmarks/e2e_width.py --out OUT [--part probes,round1] [--rounds 3] ...
    python benchmarks/e2e_width.py --merge OUT/e2e_width_part*.json --write benchmarks/results/e2e_width_h200.json

Model: 4 layers, hidden 4096, FFN 16384, vocabulary 128256, sequence 4096, micro-batch
1 x 4 micro-batches, ``optim_grads_params``, TE layer spec, untied output layer, megatron-core's
GPT through validation/parity/train_gpt_fsdp.py (steps 10, the first 2 untimed).

Configurations:
  * ``fusion_off``: gradient-accumulation fusion off, fp32 main grads; plain torchrun, no gemm_patch.
  * ``patched``: fusion on, fp32 main grads, under ``python -m gemm_patch run`` (all defaults).
  * ``bf16_grads``: fusion on, bf16 main grads, under gemm_patch.
Extras, one round each: ``patched_dummy_off`` (GEMM_PATCH_FSDP_DUMMY_GRAD=0: megatron's own dummy
grad_weight, i.e. gemm-patch 0.2.0) and ``patched_te_fresh`` (an experiment, not a feature: TE's
per-shape dummy cache replaced by a per-call allocation, benchmarks/step_probe.py).
Probes: ``fusion_off`` and ``patched`` with a memory history up to step 3 and a
profile of step 4 (benchmarks/step_probe.py), on 2 GPUs (``probes1``: also 1 GPU; ``bf16probe``:
``bf16_grads`` on 2 GPUs); their timings are not used.

On a 2-GPU machine two 1-GPU processes run at once, one per GPU (the pairs rotate between rounds,
and the JSON records who ran beside whom); 2-GPU processes run alone. Every process has a
timeout, no process starts after ``--deadline`` seconds, and the part JSON is rewritten after each
process, so a cut-off run still leaves what finished.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "validation.parity.train_gpt_fsdp"  # run as a module from the repository root
MODEL = {"layers": 4, "hidden": 4096, "seq": 4096, "vocab": 128256, "micro_batch_size": 1,
         "micro_batches": 4, "sharding": "optim_grads_params", "steps": 10, "untimed": 2}
# The second, wider model: hidden 8192, 2 layers (FFN 32768), same vocabulary.
WIDE = {**MODEL, "layers": 2, "hidden": 8192}
FFN = 4  # train_gpt_fsdp.py builds FFN = 4 x hidden (16384 at hidden 4096)
H200_BF16_DENSE_TFLOPS = 989.4  # NVIDIA's H200 SXM datasheet, dense bf16
CONFIGS = {
    "fusion_off": {"flags": ["--fusion", "off", "--main-grads-dtype", "fp32"], "patched": False, "env": {}},
    "patched": {"flags": ["--fusion", "on", "--main-grads-dtype", "fp32"], "patched": True, "env": {}},
    "bf16_grads": {"flags": ["--fusion", "on", "--main-grads-dtype", "bf16"], "patched": True, "env": {}},
    "patched_dummy_off": {"flags": ["--fusion", "on", "--main-grads-dtype", "fp32"], "patched": True,
                          "env": {"GEMM_PATCH_FSDP_DUMMY_GRAD": "0"}},
    "patched_te_fresh": {"flags": ["--fusion", "on", "--main-grads-dtype", "fp32", "--te-dummy", "fresh"],
                         "patched": True, "env": {}},
}
MAIN = ("fusion_off", "patched", "bf16_grads")


def flops_per_token(m: dict[str, Any]) -> float:
    """Model FLOPs of one token's forward and backward (6 x the matmul parameters it touches,
    output layer included, embedding lookup not; plus causal-free attention 12 x L x H x S)."""
    h, layers = m["hidden"], m["layers"]
    per_layer = 4 * h * h + 2 * h * FFN * h
    return 6 * (layers * per_layer + h * m["vocab"]) + 12 * layers * h * m["seq"]


def command(config: str, gpus: int, name: str, part: Path, probe_dir: Path | None) -> list[str]:
    m = MODEL
    cmd = ["torchrun", "--standalone", f"--nproc-per-node={gpus}", "-m", SCRIPT, "--name", name,
           "--out", str(part), "--layers", str(m["layers"]), "--hidden", str(m["hidden"]),
           "--seq", str(m["seq"]), "--vocab", str(m["vocab"]), "--micro-batch-size", str(m["micro_batch_size"]),
           "--micro-batches", str(m["micro_batches"]), "--sharding", m["sharding"],
           "--steps", str(m["steps"] if probe_dir is None else 4), "--untimed-steps", str(m["untimed"]),
           "--lr-warmup-steps", "1", *CONFIGS[config]["flags"]]
    if probe_dir is not None:
        cmd += ["--probe-dir", str(probe_dir), "--probe-step", "3"]
    if CONFIGS[config]["patched"]:
        cmd = [sys.executable, "-m", "gemm_patch", "run", "--", *cmd]
    return cmd


def schedule(part: str, rounds: int) -> list[list[dict[str, Any]]]:
    """Slots of tasks; the tasks of one slot run at once (two 1-GPU tasks, or one 2-GPU task)."""
    slots: list[list[dict[str, Any]]] = []
    if "probes" in part:
        if "probes1" in part:
            slots.append([{"config": "fusion_off", "gpus": 1, "probe": True, "gpu": "0"},
                          {"config": "patched", "gpus": 1, "probe": True, "gpu": "1"}])
        slots += [[{"config": c, "gpus": 2, "probe": True}] for c in ("fusion_off", "patched")]
    if "bf16probe" in part:  # where bf16 gradients' lead over patched comes from (2 GPUs)
        slots.append([{"config": "bf16_grads", "gpus": 2, "probe": True}])
    if "extras" in part:
        slots.append([{"config": "patched_dummy_off", "gpus": 1, "gpu": "0", "round": 1},
                      {"config": "patched_te_fresh", "gpus": 1, "gpu": "1", "round": 1}])
        slots += [[{"config": c, "gpus": 2, "round": 1}] for c in ("patched_dummy_off", "patched_te_fresh")]
    for r in range(1, rounds + 1):
        if f"round{r}" not in part and "rounds" not in part:
            continue
        order = [MAIN[(i + r - 1) % 3] for i in range(3)]  # rotate: each config leads once
        slots.append([{"config": order[0], "gpus": 1, "gpu": "0", "round": r},
                      {"config": order[1], "gpus": 1, "gpu": "1", "round": r}])
        slots.append([{"config": order[2], "gpus": 1, "gpu": str((r + 1) % 2), "round": r}])
        slots += [[{"config": c, "gpus": 2, "round": r}] for c in order]
    return slots


def run_slot(slot: list[dict[str, Any]], scratch: Path, limit: float, log) -> None:
    procs = []
    for task in slot:
        tag = f"{task['config']}.g{task['gpus']}." + ("probe" if task.get("probe") else f"r{task['round']}")
        task["name"] = tag
        part = scratch / f"{tag}.json"
        probe_dir = scratch / "probes" if task.get("probe") else None
        env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH")}
        env.update(CONFIGS[task["config"]]["env"])
        env["PYTHONUNBUFFERED"] = "1"
        # gemm_patch from this checkout in the launcher and in every worker it starts.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        if task["gpus"] == 1:
            env["CUDA_VISIBLE_DEVICES"] = task["gpu"]
        task["beside"] = [t["config"] for t in slot if t is not task]
        cmd = command(task["config"], task["gpus"], tag, part, probe_dir)
        handle = open(scratch / f"{tag}.log", "w")
        procs.append((task, part, handle, subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                                          cwd=ROOT, start_new_session=True), time.time()))
    for task, part, handle, proc, t0 in procs:
        try:
            proc.wait(timeout=max(1.0, limit - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            task["timed_out"] = True
        handle.close()
        task["rc"], task["seconds"] = proc.returncode, round(time.time() - t0, 1)
        if part.exists():
            task["result"] = summarise_part(json.loads(part.read_text()))
        for kind in ("memory", "profile") if task.get("probe") else ():
            probe_file = scratch / "probes" / f"{task['name']}.{kind}.json"
            if probe_file.exists():  # the full attribution travels inside the part JSON
                task[f"probe_{kind}"] = json.loads(probe_file.read_text())
        tail = (scratch / f"{task['name']}.log").read_text(errors="replace").splitlines()[-12:]
        if task["rc"] != 0:
            task["log_tail"] = tail
        ok = "median_step_ms" in task.get("result", {})
        log(f"{task['name']:32s} rc={task['rc']} {task['seconds']:6.1f}s beside={task['beside']} "
            + (_line(task["result"]) if ok else str(task.get("result", {}).get("error"))[:600] + " | "
               + " | ".join(tail[-4:])))


def summarise_part(data: dict[str, Any]) -> dict[str, Any]:
    run = data["runs"][0] if "runs" in data else data
    if "summary" not in run:  # the run failed inside the process: keep what it said
        return {"error": {k: v for k, v in run.items() if k not in ("config",)}}
    s = run["summary"]
    return {"median_step_ms": round(s["median_step_time_s"] * 1e3, 2),
            "tokens_per_s": round(s["median_tokens_per_s"], 1),
            "peak_gib": round(s["peak_mem_bytes"] / 2**30, 3),
            "peak_reserved_gib": round(s.get("peak_reserved_bytes", 0) / 2**30, 3),
            "step_ms": [round(x["step_time_s"] * 1e3, 1) for x in run["steps"]],
            "final_loss": s["final_loss"], "probe": run.get("probe"),
            "te_dummy_rebound": run.get("te_dummy_rebound"),
            "main_grad_buffer_dtypes": run.get("main_grad_buffer_dtypes"),
            "environment": {k: v for k, v in data.items() if k != "runs"}}


def _line(r: dict[str, Any]) -> str:
    return f"{r['median_step_ms']:8.1f} ms  {r['peak_gib']:7.3f} GiB  reserved {r['peak_reserved_gib']:7.3f}"


def merge(parts: list[Path]) -> dict[str, Any]:
    """All parts' tasks -> one result: results[gpus][config] with medians over rounds."""
    loaded = [json.loads(p.read_text()) for p in parts]
    tasks = [t for part in loaded for t in part["tasks"]]
    model = loaded[0].get("model", MODEL)  # parts before the --model option ran the base model
    if any(part.get("model", MODEL) != model for part in loaded):
        raise SystemExit("the parts ran different models; merge each model's parts on its own")
    results: dict[str, dict[str, Any]] = {}
    env = next((t["result"]["environment"] for t in tasks if t.get("result", {}).get("environment")), None)
    for gpus in ("1", "2"):
        for config in CONFIGS:
            done = [t for t in tasks if str(t["gpus"]) == gpus and t["config"] == config
                    and not t.get("probe") and "median_step_ms" in t.get("result", {})]
            if not done:
                continue
            steps = [t["result"]["median_step_ms"] for t in done]
            med = statistics.median(steps)
            tps = statistics.median(t["result"]["tokens_per_s"] for t in done)
            results.setdefault(gpus, {})[config] = {
                "median_step_ms": round(med, 2), "rounds": len(done),
                "round_median_step_ms": steps,
                "tokens_per_s": round(tps, 1),
                "mfu": round(flops_per_token(model) * tps / (int(gpus) * H200_BF16_DENSE_TFLOPS * 1e12), 4),
                "peak_gib": max(t["result"]["peak_gib"] for t in done),
                "peak_gib_per_round": [t["result"]["peak_gib"] for t in done],
                "peak_reserved_gib": max(t["result"]["peak_reserved_gib"] for t in done),
                "beside": [t["beside"] for t in done],
                "main_grad_buffer_dtypes": done[0]["result"]["main_grad_buffer_dtypes"],
            }
        base = results.get(gpus, {})
        for r in base.values():
            if "fusion_off" in base:
                r["step_vs_fusion_off"] = round(r["median_step_ms"] / base["fusion_off"]["median_step_ms"], 4)
                r["peak_minus_fusion_off_gib"] = round(r["peak_gib"] - base["fusion_off"]["peak_gib"], 3)
            if "bf16_grads" in base:
                r["step_vs_bf16_grads"] = round(r["median_step_ms"] / base["bf16_grads"]["median_step_ms"], 4)
    probes = {t["name"]: {"result": t.get("result", {}).get("probe"), "memory": t.get("probe_memory"),
                          "profile": t.get("probe_profile"), "rc": t.get("rc")} for t in tasks if t.get("probe")}
    return {"schema": "gemm_patch.e2e_width/1", "benchmark": "width", "model": model,
            "gpus": sorted({g for part in loaded for g in part.get("gpus", [])}),
            "flops_per_token": flops_per_token(model), "peak_tflops_per_gpu": H200_BF16_DENSE_TFLOPS,
            "environment": env, "results": results, "probes": probes,
            "failed": [{k: t.get(k) for k in ("name", "rc", "timed_out", "log_tail")} for t in tasks if t.get("rc")],
            "tasks": [_task_record(t) for t in tasks]}


def _task_record(t: dict[str, Any]) -> dict[str, Any]:
    kept = {k: v for k, v in t.items() if k != "result" and not k.startswith("probe_")}
    kept["result"] = {k: v for k, v in t.get("result", {}).items() if k not in ("probe", "environment")}
    return kept


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for e2e_width_<part>.json and the logs")
    p.add_argument("--part", default="probes,extras,rounds",
                   help="probes[,probes1], bf16probe, extras, round1..roundN, rounds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--deadline", type=float, default=480, help="no process starts after this many seconds")
    p.add_argument("--proc-limit", type=float, default=110)
    p.add_argument("--scratch", default="/tmp/e2e_width")
    p.add_argument("--model", choices=("base", "wide"), default="base",
                   help="base: hidden 4096, 4 layers; wide: hidden 8192, 2 layers (the wider model)")
    p.add_argument("--merge", nargs="*", help="part JSONs to merge (no run)")
    p.add_argument("--write", help="with --merge: the merged JSON")
    args = p.parse_args()
    if args.merge:
        merged = merge([Path(x) for x in args.merge])
        Path(args.write).write_text(json.dumps(merged, indent=1) + "\n")
        for gpus, configs in merged["results"].items():
            for name, r in configs.items():
                print(f"{gpus} GPU  {name:18s} {r['median_step_ms']:8.1f} ms  peak {r['peak_gib']:7.3f} GiB  "
                      f"vs off {r.get('step_vs_fusion_off')}  dpeak {r.get('peak_minus_fusion_off_gib')}")
        return 0
    if args.model == "wide":
        MODEL.update(WIDE)
    out, scratch = Path(args.out), Path(args.scratch)
    out.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    tasks: list[dict[str, Any]] = []
    part_file = out / f"e2e_width_{args.model}_{args.part.replace(',', '_')}.json"
    lines: list[str] = []

    def log(msg: str) -> None:
        line = f"[+{time.time() - t0:5.0f}s] {msg}"
        print(line, flush=True)
        lines.append(line)

    for slot in schedule(args.part, args.rounds):
        if time.time() - t0 > args.deadline:
            log(f"deadline: not started {[t['config'] + '.g' + str(t['gpus']) for t in slot]}")
            continue
        run_slot(slot, scratch, args.proc_limit, log)
        tasks += slot
        part_file.write_text(json.dumps({"part": args.part, "model": MODEL, "gpus": smi.stdout.strip().splitlines(),
                                         "tasks": tasks, "log": lines}, indent=1))
    print("\n".join(lines[-40:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
