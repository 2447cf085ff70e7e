"""Memory and the first steps at several data-parallel ranks on one GPU: fusion off against
gemm-patch, and megatron's own fused path where the release has one.

    python -m validation.shared_gpu.memory --out OUT [--cases 0.17.1:2,0.17.1:4] [--timing-cases 0.19.2:2]

The model is the one where gemm-patch's max allocated was seen above fusion off's: hidden 1024,
vocabulary 32000, tied embeddings, one MTP layer, ``optim_grads``. Each run trains ``--steps``
steps of 4 micro-batches per rank; its record (``kind: "memory"``) holds what stays allocated
after the last step and the largest max allocated of any step (each the largest over ranks),
and every step's time. The ``--cases`` processes run at the same time (a process's own
allocations do not depend on the others'; their step times do), the ``--timing-cases`` ones one
after another, alone on the GPU (``alone: true``: their step times count). ``--probe`` cases also
record the CUDA memory history up to step 2 (``benchmarks/step_probe.py``): rank 0's blocks alive
at that step's peak, by allocating frame, go to ``OUT/<name>.memory.json``. Records are appended
to ``OUT/many_ranks_memory.jsonl`` as each run ends.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from validation.shared_gpu.launch import launch
from validation.shared_gpu.parity import ENTRY, SCRIPT, process_env, upstream_control, write_logs

CASE = "tied_mtp_h1024_optim_grads"
MODEL = {"layers": 4, "hidden": 1024, "seq": 1024, "vocab": 32000, "micro_batch_size": 2, "micro_batches": 4,
         "tied": "on", "mtp_layers": 1, "moe_experts": 0, "sharding": "optim_grads", "main_grads_dtype": "fp32",
         "lr": 1e-4, "mode": "train"}


def configs_for(release: str) -> tuple[str, ...]:
    """fusion off, gemm-patch and megatron's own fused path (``parity.upstream_control``)."""
    return ("fusion_off", "patched", "upstream")


def run_one(args: argparse.Namespace, release: str, ranks: int, config: str, probe: bool,
            alone: bool) -> dict[str, Any]:
    """One configuration's process. ``probe``: with the memory history up to step 2 (its step
    times are not comparable); ``alone``: nothing else on the GPU (its step times are)."""
    scratch = Path(args.scratch)
    name = f"{release}.dp{ranks}.{config}{'.alone' if alone else ''}.{time.time_ns() % 10**6}"
    # With the history, 2 steps: the probe would profile a third (step_probe: the step after).
    run = {**MODEL, "name": name, "steps": 2 if probe else args.steps,
           "fusion": "off" if config == "fusion_off" else "on",
           **({"probe_dir": str(Path(args.out)), "probe_step": 2} if probe else {})}
    plan_file = scratch / f"{name}.plan.json"
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    plan_file.write_text(json.dumps([run]))
    out = scratch / f"{name}.json"
    t0 = time.time()
    rc = launch([sys.executable, str(SCRIPT), "--plan", str(plan_file), "--out", str(out)], ranks,
                env=process_env(args, release, config), cwd=str(scratch), log_dir=scratch / "logs" / name,
                timeout_s=args.proc_limit)
    print(f"{name}: rc={rc} in {time.time() - t0:.0f} s", flush=True)
    try:
        part = json.loads(out.read_text())
        result = part["runs"][0]
        steps = result["steps"]
    except (OSError, ValueError, KeyError, IndexError):
        return {"kind": "memory", "entry": ENTRY, "release": release, "ranks": ranks, "case": CASE, "config": config,
                "alone": alone, "error": f"no result (rc={rc})", "one_gpu": True}
    return {
        "kind": "memory", "entry": ENTRY, "release": release, "ranks": ranks, "case": CASE, "config": config,
        "alone": alone, "memory_history": probe, "allocated_bytes": steps[-1]["allocated_bytes"],
        "max_allocated_bytes": max(s["peak_mem_bytes"] for s in steps),
        "max_allocated_by_step": [s["peak_mem_bytes"] for s in steps],
        "step_times_s": [round(s["step_time_s"], 4) for s in steps],
        "losses": [s["loss"] for s in steps],
        "control": upstream_control(release)[2] if config == "upstream" else None,
        "megatron_core": part.get("versions", {}).get("megatron_core"), "device": part.get("gpu"),
        "one_gpu": True, "model": {k: v for k, v in MODEL.items() if k != "mode"},
    }


def write_record(out: Path, record: dict[str, Any] | None) -> None:
    if record is not None:
        with (out / "many_ranks_memory.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> int:
    from concurrent.futures import ThreadPoolExecutor

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="0.17.1:2,0.17.1:4",
                   help="RELEASE:RANKS, comma-separated: memory, every process at the same time (each "
                        "process's own allocations do not depend on the others)")
    p.add_argument("--configs", default="fusion_off,patched,upstream", help="the configurations of --cases")
    p.add_argument("--timing-cases", default="0.19.2:1",
                   help="RELEASE:RANKS: step times, one process at a time (alone on the GPU)")
    p.add_argument("--timing-configs", default="fusion_off,patched,fusion_off,patched",
                   help="in this order, each alone: a configuration twice shows what running first costs")
    p.add_argument("--probe", default="0.17.1:2", help="RELEASE:RANKS of --cases run with the memory history")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mcore-root", default="/tmp/gp")
    p.add_argument("--scratch", default="/tmp/shared_gpu_memory")
    p.add_argument("--proc-limit", type=float, default=180)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def runs(cases: str, configs: str) -> list[tuple[str, int, str]]:
        pairs = [case.split(":") for case in cases.split(",") if case]
        return [(release, int(ranks), config) for release, ranks in pairs for config in configs.split(",")]

    probed = set(args.probe.split(","))
    with ThreadPoolExecutor(16) as pool:
        for record in pool.map(lambda r: run_one(args, *r, probe=f"{r[0]}:{r[1]}" in probed, alone=False),
                               runs(args.cases, args.configs)):
            write_record(out, record)
    for i, (release, ranks, config) in enumerate(runs(args.timing_cases, args.timing_configs)):
        write_record(out, {**run_one(args, release, ranks, config, probe=False, alone=True), "order": i})
    write_logs(out / "many_ranks_memory_logs.txt.gz", sorted((Path(args.scratch) / "logs").iterdir()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
