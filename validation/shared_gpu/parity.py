"""Per-parameter gradient parity at several data-parallel ranks on one GPU (correctness only).

    python -m validation.shared_gpu.parity --out OUT [--releases 0.17.1,0.19.2] [--ranks 2,4,8]

On the GPU machine, from the folder holding the GPU kit (``.devkit``, megatron-core under
``--mcore-root``) and this checkout. For every (release, ranks) it starts, through
``validation.shared_gpu.launch``, one process of ``validation/parity/train_gpt_fsdp.py`` per
configuration and runs every case of ``LAYOUTS`` x ``STRATEGIES`` in it: one step of 4
micro-batches per rank, the full reduced gradient dumped after ``finalize_model_grads``:

* ``fusion_off``: gradient-accumulation fusion off, fp32 main grads, no gemm_patch (the
  reference); it also runs the fp64 oracle of the dense layouts without MTP (rank 0 runs every
  rank's micro-batches in float64: ``autograd_oracle.run_fp64_oracle``);
* ``patched``: fusion on under ``python -m gemm_patch run``;
* ``upstream``: megatron's own behaviour, the control that shows the comparison can fail.
  megatron-core 0.19 writes fp32 main grads itself but refuses fusion without apex: there every
  gemm_patch target is left out (``GEMM_PATCH_DISABLE``) but apex's stand-in. Older releases raise
  megatron's dtype error on the output layer's fused write without gemm_patch, so there every fix
  is left out but that write, and it overwrites as megatron's ``torch.matmul(..., out=main_grad)``
  does (``wgrad_rule: overwrite``). te-dummy-wgrad stays in both (it changes memory, not gradients).

Expert parallelism equal to data parallelism (``moe_ep``: every expert on one rank, its
gradient reduced over a one-rank group) needs its own process per configuration (one model
parallel layout per process).

Each finished (release, ranks) appends one JSON record per case and configuration to
``OUT/many_ranks.jsonl`` (``RECORD_KEYS``), so a run cut short keeps what it finished;
``--merge OUT/many_ranks.jsonl`` adds them to ``validation/results/many_ranks.jsonl``
and rewrites its table (``validation.shared_gpu.table``).

The rule is the parity campaigns' (validation/README.md, "Rules the comparisons use"): per
parameter rel = ||g - g_ref|| / ||g_ref||, ``passed`` when the largest rel <= 2^-7 (fusion off
is bitwise repeatable here, so no noise term is added). The reference is fusion off under the
same strategy, itself checked against fusion off under ``no_shard`` (``reference_of``): with
expert parallelism equal to data parallelism, fusion off under a sharded strategy is wrong
(experts N x at N ranks), and the record is then judged against fusion off under ``no_shard``
and says so (``reference``). A run that agrees with a wrong fusion off fails.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from validation.parity import run_coverage
from validation.shared_gpu.launch import launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "validation" / "parity" / "train_gpt_fsdp.py"
RESULTS = ROOT / "validation" / "results" / "many_ranks.jsonl"
BOUND = run_coverage.BOUND
ENTRY = "train_gpt_fsdp"

LAYOUTS: dict[str, dict[str, Any]] = {
    "untied": {"tied": "off", "mtp_layers": 0, "moe_experts": 0},
    "tied": {"tied": "on", "mtp_layers": 0, "moe_experts": 0},
    "tied_mtp": {"tied": "on", "mtp_layers": 1, "moe_experts": 0},
    "moe": {"tied": "off", "mtp_layers": 0, "moe_experts": 8},
    # expert parallel = data parallel: each expert's gradient is reduced over a one-rank group
    "moe_ep": {"tied": "off", "mtp_layers": 0, "moe_experts": 8, "ep_is_dp": True},
    # Megatron-FSDP's fine-grained parameter gather: every module unshards its own weights (the
    # tied output layer and the MTP head each gather the embedding's), where the release has it
    "tied_mtp_fine_gather": {"tied": "on", "mtp_layers": 1, "moe_experts": 0, "fine_grained_param_gather": "on",
                             "releases": ("0.19.",)},
    "moe_fine_gather": {"tied": "off", "mtp_layers": 0, "moe_experts": 8, "fine_grained_param_gather": "on",
                        "releases": ("0.19.",)},
}
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
CONFIGS = ("fusion_off", "patched", "upstream")
# The fp64 oracle runs a dense model without MTP.
FP64_LAYOUTS = ("untied", "tied")
# What "upstream" leaves out where megatron cannot run fused fp32 main grads itself: every fix
# but fsdp-wgrad's write (without which the output layer raises megatron's dtype error).
FIXES = ("fsdp-te-overwrite", "mfsdp-te-overwrite", "fsdp-shared-grad", "mfsdp-shared-grad", "moe-te-overwrite",
         "fsdp-embedding-wgrad", "moe-router-wgrad",
         "fsdp-one-rank-scale", "mfsdp-one-rank-scale", "fsdp-te-overwrite-by-strategy",
         "mfsdp-te-overwrite-by-strategy")
NATIVE_FUSED_FP32 = ("0.19.",)  # releases whose own fused path writes fp32 main grads
# There: everything but apex's stand-in (megatron refuses fusion without apex) and te-dummy-wgrad.
NATIVE_LEFT_OUT = (*FIXES, "fsdp-wgrad", "fsdp-wgrad-gemm")
RECORD_KEYS = ("entry", "release", "ranks", "layout", "strategy", "tied", "mtp", "moe", "ep",
               "fine_grained_param_gather", "config",
               "max_rel_err_vs_off", "worst_param_vs_off", "reference", "max_rel_err_vs_reference",
               "max_rel_err_vs_off_no_shard", "max_rel_err_vs_fp64", "passed", "bound", "control",
               "error", "megatron_core", "transformer_engine", "device", "one_gpu",
               "max_allocated_bytes", "allocated_bytes", "previous_run")
SHAPE_KEYS = ("tied", "mtp_layers", "moe_experts", "fine_grained_param_gather")


def layouts_for(release: str, layouts: list[str]) -> list[str]:
    """The layouts of ``layouts`` that ``release`` has (fine-grained gather: 0.19 and later)."""
    return [name for name in layouts if release.startswith(LAYOUTS[name].get("releases", ("",)))]


def upstream_control(release: str) -> tuple[dict[str, str], str | None, str]:
    """(environment, wgrad rule, description) of the upstream control on ``release``."""
    if release.startswith(NATIVE_FUSED_FP32):
        return ({"GEMM_PATCH_DISABLE": ",".join(NATIVE_LEFT_OUT)}, None,
                "megatron's own fused path: every target left out (GEMM_PATCH_DISABLE) but apex-wgrad "
                "(apex's stand-in) and te-dummy-wgrad")
    return ({"GEMM_PATCH_DISABLE": ",".join(FIXES)}, "overwrite",
            "every fix left out (GEMM_PATCH_DISABLE) but fsdp-wgrad's write, which overwrites as megatron's does")


def dump_file(scratch: Path, release: str, ranks: int, config: str, layout: str, strategy: str) -> Path:
    return scratch / "dumps" / release / f"dp{ranks}" / config / f"{layout}.{strategy}.pt"


def plan(args: argparse.Namespace, scratch: Path, release: str, ranks: int, config: str,
         layouts: list[str]) -> list[dict[str, Any]]:
    """The runs of one process: every layout of ``layouts`` (all with the same expert parallelism)
    under every strategy, one step each; the fp64 oracles last in the fusion-off process, so every
    configuration's training runs follow the same runs (what a run leaves allocated is in the
    next one's baseline)."""
    model = {"layers": args.layers, "hidden": args.hidden, "seq": args.seq, "vocab": args.vocab,
             "micro_batch_size": 2, "micro_batches": 4, "steps": 1, "lr": 1e-4, "main_grads_dtype": "fp32",
             "fusion": "off" if config == "fusion_off" else "on"}
    wgrad_rule = upstream_control(release)[1] if config == "upstream" else None
    runs, oracles = [], []
    for layout in layouts:
        lay = LAYOUTS[layout]
        shape = {k: lay[k] for k in SHAPE_KEYS if k in lay}
        if lay.get("ep_is_dp"):
            shape["ep"] = ranks
        if config == "fusion_off" and layout in FP64_LAYOUTS and args.fp64 == "on":
            oracles.append({**model, **shape, "name": f"{layout}.fp64", "mode": "fp64",
                            "grad_dump": str(dump_file(scratch, release, ranks, config, layout, "fp64"))})
        for strategy in args.strategies.split(","):
            runs.append({**model, **shape, "name": f"{layout}.{strategy}", "mode": "train", "sharding": strategy,
                         "grad_dump": str(dump_file(scratch, release, ranks, config, layout, strategy)),
                         **({"wgrad_rule": wgrad_rule} if wgrad_rule else {})})
    return runs + oracles


def process_env(args: argparse.Namespace, release: str, config: str) -> dict[str, str]:
    """The environment of one configuration's ranks: megatron-core ``release`` and the kit first
    on PYTHONPATH, gemm_patch's start-up hook for the fused configurations, ``GEMM_PATCH=0`` for
    fusion off."""
    from gemm_patch.commands.launcher import launch_env

    mc = str(Path(args.mcore_root) / f"mc{release.replace('.', '')}")
    site = str(Path(args.mcore_root) / "site")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), mc, site])
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    if config == "fusion_off":
        # megatron alone, even where gemm_patch is installed with its start-up hook: its reduce fix
        # (fsdp-one-rank-scale) changes fusion off's gradients too
        return {**env, "GEMM_PATCH": "0"}
    if config == "upstream":
        env.update(upstream_control(release)[0])
    return launch_env(env)


def run_process(args: argparse.Namespace, scratch: Path, release: str, ranks: int, config: str,
                layouts: list[str], tag: str) -> dict[str, Any]:
    name = f"{release}.dp{ranks}.{tag}.{config}"
    runs = plan(args, scratch, release, ranks, config, layouts)
    plan_file = scratch / "plans" / f"{name}.json"
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    plan_file.write_text(json.dumps(runs, indent=1))
    out = scratch / "parts" / f"{name}.json"
    cmd = [sys.executable, str(SCRIPT), "--plan", str(plan_file), "--out", str(out)]
    t0 = time.time()
    rc = launch(cmd, ranks, env=process_env(args, release, config), cwd=str(scratch),
                log_dir=scratch / "logs" / name, timeout_s=process_limit(args, t0))
    print(f"[{time.time() - args.t0:6.0f}s] {name}: rc={rc} in {time.time() - t0:.0f} s", flush=True)
    try:
        part = json.loads(out.read_text())
    except (OSError, ValueError):
        part = None
    return {"name": name, "rc": rc, "seconds": round(time.time() - t0, 1), "part": part}


def process_limit(args: argparse.Namespace, now: float) -> float:
    """Seconds a process starting at ``now`` may run: ``--proc-limit``, and no later than ``--stop-at``
    (so the records of the processes that finished are written before an outer limit ends the run)."""
    if args.stop_at is None:
        return args.proc_limit
    return max(1.0, min(args.proc_limit, args.t0 + args.stop_at - now))


def reference_of(scratch: Path, release: str, ranks: int, layout: str, strategy: str,
                 cache: dict) -> tuple[str, Path, dict[str, Any] | None]:
    """The reference a (layout, strategy) is judged against (its name and dump), and fusion off's own check.

    Fusion off under ``no_shard`` reduces by all-reduce alone; under a sharded strategy it
    reduce-scatters, and a reduce-scatter over a one-rank group drops Megatron-FSDP's factor
    (expert parallel = data parallel: experts N x at N ranks, with or without fusion). Where fusion
    off under ``strategy`` differs from fusion off under ``no_shard`` beyond the bound, the
    reference is the latter (``fusion_off_no_shard``), and the check says by how much; else it is
    fusion off under ``strategy``."""
    off, all_reduce = (dump_file(scratch, release, ranks, "fusion_off", layout, s) for s in (strategy, "no_shard"))
    if strategy == "no_shard":
        return "fusion_off", off, None
    check = compare_dumps(off, all_reduce, cache)
    if check is not None and check["max_rel_diff"] is not None and check["max_rel_diff"] > BOUND:
        return "fusion_off_no_shard", all_reduce, check
    return "fusion_off", off, check


def _ratios(result: dict[str, Any] | None) -> list[float] | None:
    return [result["min_norm_ratio"], result["max_norm_ratio"]] if result else None


def compare_dumps(got: Path, ref: Path, cache: dict) -> dict[str, Any] | None:
    a, b = run_coverage.load_dump(got, cache), run_coverage.load_dump(ref, cache)
    if a is None or b is None:
        return None
    return run_coverage.compare(a, b, [])


def records(args: argparse.Namespace, scratch: Path, release: str, ranks: int, layouts: list[str],
            procs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (layout, strategy, configuration) of a finished (release, ranks)."""
    cache: dict[str, Any] = {}
    part = next((p["part"] for p in procs.values() if p.get("part")), None) or {}
    versions = part.get("versions", {})
    control = upstream_control(release)[2]
    out = []
    for layout in layouts:
        lay = LAYOUTS[layout]
        for strategy in args.strategies.split(","):
            off = dump_file(scratch, release, ranks, "fusion_off", layout, strategy)
            fp64 = (dump_file(scratch, release, ranks, "fusion_off", layout, "fp64")
                    if layout in FP64_LAYOUTS and args.fp64 == "on" else None)
            reference, ref, off_check = reference_of(scratch, release, ranks, layout, strategy, cache)
            for config in args.configs.split(","):
                got = dump_file(scratch, release, ranks, config, layout, strategy)
                vs_off = compare_dumps(got, off, cache) if config != "fusion_off" else None
                vs_ref = compare_dumps(got, ref, cache) if config != "fusion_off" else None
                vs_fp64 = compare_dumps(got, fp64, cache) if fp64 is not None else None
                proc = procs.get(f"{layout}.{config}") or {}
                run, previous = _run(proc.get("part"), f"{layout}.{strategy}")
                failed = _failed_run(run)
                error = failed or (None if got.exists() else f"no gradient dump (process rc={proc.get('rc')})")
                check = off_check if config == "fusion_off" else None
                out.append({
                    "entry": ENTRY, "release": release, "ranks": ranks, "layout": layout, "strategy": strategy,
                    "tied": lay["tied"] == "on", "mtp": bool(lay["mtp_layers"]), "moe": bool(lay["moe_experts"]),
                    "ep": ranks if lay.get("ep_is_dp") else 1,
                    "fine_grained_param_gather": run.get("fine_grained_param_gather_hook") if run else None,
                    "config": config,
                    "max_rel_err_vs_off": vs_off["max_rel_diff"] if vs_off else None,
                    "worst_param_vs_off": vs_off["worst_param"] if vs_off else None,
                    "norm_ratio_vs_off": _ratios(vs_off),
                    "reference": reference,
                    "max_rel_err_vs_reference": vs_ref["max_rel_diff"] if vs_ref else None,
                    "worst_param_vs_reference": vs_ref["worst_param"] if vs_ref else None,
                    "max_rel_err_vs_fp64": vs_fp64["max_rel_diff"] if vs_fp64 else None,
                    # fusion off's record: its own check against fusion off under no_shard
                    "max_rel_err_vs_off_no_shard": check["max_rel_diff"] if check else None,
                    "worst_param_vs_off_no_shard": check["worst_param"] if check else None,
                    "norm_ratio_vs_off_no_shard": _ratios(check),
                    "passed": (vs_ref["max_rel_diff"] <= BOUND) if vs_ref and not error else None,
                    "bound": BOUND, "control": control if config == "upstream" else None, "error": error,
                    "megatron_core": versions.get("megatron_core"),
                    "transformer_engine": versions.get("transformer_engine"),
                    "device": part.get("gpu"), "one_gpu": True, "micro_batches": 4,
                    **_memory(run), "previous_run": previous,
                    "model": {k: getattr(args, k) for k in ("layers", "hidden", "seq", "vocab")},
                })
    for path in (scratch / "dumps" / release / f"dp{ranks}").rglob("*.pt"):
        path.unlink()  # compared: the disk holds one (release, ranks) at a time
    return out


def _run(part: dict[str, Any] | None, name: str) -> tuple[dict[str, Any] | None, str | None]:
    """The run ``name`` of a process and the name of the run before it (its memory baseline holds
    what that one left allocated)."""
    runs = (part or {}).get("runs", [])
    for i, run in enumerate(runs):
        if run.get("name") == name:
            return run, runs[i - 1].get("name") if i else None
    return None, None


def _failed_run(run: dict[str, Any] | None) -> str | None:
    if run and (run.get("error") or run.get("unsupported")):
        return (run.get("error") or run.get("unsupported"))[:300]
    return None


def _memory(run: dict[str, Any] | None) -> dict[str, Any]:
    """The step's max allocated and what stays allocated after it, each the largest over ranks and
    above what the process's earlier runs left allocated (every configuration runs the same
    sequence); the gradient dump's buffers are not counted (``train_gpt_fsdp``)."""
    if not run or not run.get("steps"):
        return {"max_allocated_bytes": None, "allocated_bytes": None}
    base = run["summary"]["mem_baseline_bytes"]
    return {"max_allocated_bytes": run["summary"]["peak_mem_above_baseline_bytes"],
            "allocated_bytes": run["steps"][-1]["allocated_bytes"] - base}


def groups(layouts: list[str]) -> list[tuple[str, list[str]]]:
    """Processes per configuration: the layouts without expert parallelism together, ``moe_ep``
    alone (a process has one model-parallel layout)."""
    plain = [name for name in layouts if not LAYOUTS[name].get("ep_is_dp")]
    ep = [name for name in layouts if LAYOUTS[name].get("ep_is_dp")]
    return [(tag, names) for tag, names in (("dense", plain), ("ep", ep)) if names]


def campaign(args: argparse.Namespace) -> int:
    """Every (ranks, release) in turn, fewest ranks first; the processes of one at the same
    time, as many as keep at most ``--max-ranks`` ranks on the GPU."""
    from concurrent.futures import ThreadPoolExecutor

    scratch, out = Path(args.scratch), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "many_ranks.jsonl"
    layouts = args.layouts.split(",")
    logs: list[Path] = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        for release in args.releases.split(","):
            if time.time() - args.t0 > args.deadline:
                print(f"skipped {release} at {ranks} ranks: past the deadline", flush=True)
                continue
            here = layouts_for(release, layouts)
            jobs = [(tag, names, config) for tag, names in groups(here) for config in args.configs.split(",")]
            with ThreadPoolExecutor(max(1, args.max_ranks // ranks)) as pool:
                done = list(pool.map(lambda job, release=release, ranks=ranks: run_process(
                    args, scratch, release, ranks, job[2], job[1], job[0]), jobs))
            procs = {f"{name}.{config}": proc for (_, names, config), proc in zip(jobs, done, strict=True)
                     for name in names}
            logs += [scratch / "logs" / proc["name"] for proc in done]
            new = records(args, scratch, release, ranks, here, procs)
            with jsonl.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in new)
            write_logs(out / f"many_ranks_logs_{args.releases.replace(',', '-')}.txt.gz", logs)
            bad = [r for r in new if r["config"] == "patched" and r["passed"] is not True]
            print(f"{release} at {ranks} ranks: {len(new)} records, patched not passed: "
                  f"{[(r['layout'], r['strategy'], r['max_rel_err_vs_off'], r['error']) for r in bad]}", flush=True)
    return 0


def write_logs(path: Path, folders: list[Path]) -> None:
    with gzip.open(path, "wt") as f:
        for folder in folders:
            for log in sorted(folder.glob("rank*.log")):
                f.write(f"==== {folder.name} {log.stem} ====\n")
                f.write(log.read_text(errors="replace")[-20000:])


def merge(new: list[Path], results: Path = RESULTS) -> int:
    """Add runs' records (parity and memory) to the committed ones (the same measurement:
    replaced) and rewrite the table beside them."""
    from validation.shared_gpu import table

    merged = {table.record_key(r): r for r in table.load(results)} if results.exists() else {}
    for path in new:
        merged.update((table.record_key(r), r) for r in table.load(path))
    results.write_text("".join(json.dumps(r) + "\n" for r in sorted(merged.values(), key=table.sort_key)))
    table.write(results)
    print(f"{results}: {len(merged)} records")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for many_ranks.jsonl and the logs")
    p.add_argument("--merge", nargs="+", metavar="JSONL",
                   help="add these records (parity.py's and memory.py's) to the committed ones; nothing runs")
    p.add_argument("--releases", default="0.17.1,0.19.2")
    p.add_argument("--ranks", default="2,4,8", help="data-parallel ranks, all on GPU 0")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"some of {', '.join(LAYOUTS)}")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"some of {', '.join(CONFIGS)}; fusion_off always (every record is judged against it)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--fp64", choices=("on", "off"), default="on",
                   help="the fp64 oracle of the dense layouts without MTP (rank 0 runs every rank's micro-batches)")
    p.add_argument("--mcore-root", default="/tmp/gp", help="the GPU kit's install root (mcXXYY per release)")
    p.add_argument("--scratch", default="/tmp/shared_gpu_parity")
    p.add_argument("--max-ranks", type=int, default=12,
                   help="ranks on the GPU at a time, all processes (each rank's NCCL socket transport busy-waits on a "
                        "core: with far more ranks than cores no process finishes)")
    p.add_argument("--proc-limit", type=float, default=240, help="seconds one process may run")
    p.add_argument("--deadline", type=float, default=480, help="seconds after which no (release, ranks) starts")
    p.add_argument("--stop-at", type=float, default=None,
                   help="seconds after the start at which every process still running is stopped; the records "
                        "then say which configuration has no gradient dump")
    args = p.parse_args(argv)
    if not args.merge and not args.out:
        p.error("--out is required unless --merge is given")
    unknown = set(args.layouts.split(",")) - set(LAYOUTS)
    if unknown:
        p.error(f"unknown layouts {sorted(unknown)}; known: {', '.join(LAYOUTS)}")
    configs = args.configs.split(",")
    if set(configs) - set(CONFIGS) or "fusion_off" not in configs:
        p.error(f"--configs {args.configs!r}: give fusion_off and any of patched, upstream "
                f"(known: {', '.join(CONFIGS)})")
    args.configs = ",".join(c for c in CONFIGS if c in configs)
    args.t0 = time.time()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge([Path(m) for m in args.merge])
    if Path(args.scratch).exists():
        shutil.rmtree(args.scratch)
    return campaign(args)


if __name__ == "__main__":
    sys.exit(main())
