#!/usr/bin/env python
"""The H200 gradient-parity campaigns. ``--campaign layouts`` (default): every layout that fits two
GPUs (layouts_campaign.py says what runs; ``--smoke`` runs each model-parallel / MoE layout once).
``--campaign tied-weights``: tied embeddings and multi-token prediction on Megatron-FSDP, before and
after gemm-patch's shared-weight fix, against both oracles (described below).

Results: validation/results/coverage.json is the list of every comparison (rows of both
campaigns, field ``campaign``: "layouts" or "tied-weights"); coverage_runs.json holds each
campaign's metadata (the tied-weights campaign's records and processes, the layouts campaign's
runs); new rows are merged in (same key replaced, the rest kept), so a partial rerun drops
nothing. ``--merge-run DIR`` merges a layouts run's layouts_rows.json and layouts_run.json into
validation/results and redraws coverage_layouts.png (plot_coverage.py).

    python -m validation.parity.run_coverage --out OUT [--releases 0.17.1,0.19.2]
        [--configs off,off_repeat,before,after]
        [--campaign tied-weights --layouts dp1_tied,dp1_tied_mtp,dp2_tied,dp2_tied_mtp] [--baseline .baseline] ...

(validation/parity/run_coverage.sh sets up the GPU kit and calls this.)

Layouts (``LAYOUTS``): ``dp1_tied``, ``dp1_tied_mtp`` (1 GPU), ``dp2_tied``, ``dp2_tied_mtp``
(2 GPUs), optional MoE variants ``*_moe`` (4 experts top-2, grouped GEMM, shared expert). Each
layout runs every Megatron-FSDP strategy of ``--strategies-dp1`` / ``--strategies-dp2``.

Configurations, one training process each per (release, layout):
  * ``off``: gradient-accumulation fusion off, fp32 main grads (oracle 1); plain torchrun, no
    gemm_patch in the process. The process first runs the autograd oracle (oracle 2,
    autograd_oracle.py) for 4 and 1 micro-batches.
  * ``off_repeat``: the same again (run-to-run noise of both oracles).
  * ``before``: fusion on under ``gemm-patch run`` with gemm-patch 0.1.0 (``--baseline``: a copy
    of commit 4c56ac3's gemm_patch/ first on PYTHONPATH).
  * ``after``: fusion on under ``gemm-patch run`` with this checkout's gemm_patch.
Per strategy each process runs STEPS steps with 4 micro-batches (gradient dump after step 1's
backward and finalize_model_grads, before the optimizer step: the full reduced gradient of every
parameter, gathered over ranks) and one step with 1 micro-batch (dump). Processes run with their
working directory in the scratch folder, so ``python -m gemm_patch`` imports the gemm_patch of
PYTHONPATH, never the checkout's by accident; each records ``gemm_patch.__file__``.

Gradient parity (per release, layout, strategy, micro-batch count, configuration):
  rel = ||g - g_ref|| / ||g_ref|| per parameter, PASS when every parameter's rel <= max(2^-7,
  3 x noise), noise = that parameter's rel between the oracle's two runs (off vs off_repeat; for
  the autograd oracle the larger of autograd-vs-autograd and off-vs-off_repeat, since the
  compared run has Megatron-FSDP's own run-to-run noise). 2^-7 = 4u, u = 2^-8 the bf16 unit
  roundoff: the fusion-off path and the oracle round each micro-batch's weight gradient to
  bf16 once before the fp32 sum, the fused path rounds nothing, so a correct fused run differs
  by about u/sqrt(3) ~ 2e-3 in norm (measured <= 1.9e-3 in the 0.1.0 campaign); a lost
  contribution of a tied weight (the embedding lookup's gradient) or a lost micro-batch is
  orders of magnitude above 2^-7.

Loss parity (STEPS steps, 4 micro-batches): PASS when max_step |x - off| <= max(3 x noise,
``--loss-floor``), noise = max_step |off - off_repeat| (fusion-off's own run-to-run noise).

Output (at most 8 files in OUT): coverage.json, coverage.md, coverage_details.json.gz (every
parameter's row, every process's JSON), coverage_logs.txt.gz.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from validation.parity import layouts_campaign as LC

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHECKOUT = HERE.parents[1]  # holds the lab's packages: last on every run's PYTHONPATH
SCRIPT = "validation.parity.train_gpt_fsdp"
BOUND = 2.0 ** -7
NOISE_FACTOR = 3.0

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp1_tied": {"gpus": 1, "tied": "on", "mtp_layers": 0, "moe_experts": 0},
    "dp1_tied_mtp": {"gpus": 1, "tied": "on", "mtp_layers": 1, "moe_experts": 0},
    "dp2_tied": {"gpus": 2, "tied": "on", "mtp_layers": 0, "moe_experts": 0},
    "dp2_tied_mtp": {"gpus": 2, "tied": "on", "mtp_layers": 1, "moe_experts": 0},
    # Controls: untied embeddings, where gemm-patch 0.1.0 is already right (the 0.1.0 campaign);
    # their fused-vs-off loss difference is the legitimate effect of fusion on the loss curve.
    "dp1_untied": {"gpus": 1, "tied": "off", "mtp_layers": 0, "moe_experts": 0},
    "dp2_untied": {"gpus": 2, "tied": "off", "mtp_layers": 0, "moe_experts": 0},
    "dp1_untied_moe": {"gpus": 1, "tied": "off", "mtp_layers": 0, "moe_experts": 4},
    "dp2_untied_moe": {"gpus": 2, "tied": "off", "mtp_layers": 0, "moe_experts": 4},
    "dp1_tied_moe": {"gpus": 1, "tied": "on", "mtp_layers": 0, "moe_experts": 4},
    "dp1_tied_mtp_moe": {"gpus": 1, "tied": "on", "mtp_layers": 1, "moe_experts": 4},
    "dp2_tied_moe": {"gpus": 2, "tied": "on", "mtp_layers": 0, "moe_experts": 4},
    "dp2_tied_mtp_moe": {"gpus": 2, "tied": "on", "mtp_layers": 1, "moe_experts": 4},
}
CONFIGS = ("off", "off_repeat", "before", "after")
PROTECT_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="where a campaign or --merge writes (not needed by --merge-run, "
                                 "--append-tied-weights)")
    p.add_argument("--campaign", choices=(LC.CAMPAIGN, LC.TIED), default=LC.CAMPAIGN,
                   help="layouts: every layout on two GPUs (layouts_campaign.py); tied-weights: tied "
                        "embeddings and MTP, before/after the shared-weight fix")
    p.add_argument("--smoke", action="store_true",
                   help="layouts: each model-parallel / MoE layout (tp2_sp, cp2, dp1_moe, ep2_moe) once, "
                        "optim_grads_params, "
                        "1 micro-batch, configs off/after (+ before for dp1_moe), on the last release given")
    p.add_argument("--results", default=str(HERE / "results"),
                   help="the folder whose coverage.json (list of rows) and coverage_runs.json the new rows are "
                        "merged into; OUT gets the merged files")
    p.add_argument("--merge-run", metavar="DIR",
                   help="merge a layouts run's layouts_rows.json and layouts_run.json (from DIR) into --results "
                        "in place, regenerate coverage.md and the plot; nothing runs")
    p.add_argument("--append-tied-weights", nargs="+", metavar="DIR",
                   help="add tied-weights runs (each DIR: a run's OUT with coverage.json and coverage_runs.json) "
                        "to --results, after the runs already there; nothing runs")
    p.add_argument("--merge", nargs="+", metavar="COVERAGE_JSON",
                   help="merge coverage.json files of several runs instead of running: records keyed by "
                        "(release, layout, strategy, micro_batches), a later file's record replacing an earlier "
                        "one; writes OUT/coverage.json and OUT/coverage.md")
    p.add_argument("--scratch", default="/tmp/gemm_patch_coverage")
    p.add_argument("--releases", default="0.17.1,0.19.2", help="megatron-core versions, comma-separated")
    p.add_argument("--mcore-root", default="/tmp/gp", help="the GPU kit's install root: mcXXYY per release")
    p.add_argument("--layouts", default=None,
                   help="default: layouts: dp1,dp2,tp2_sp,cp2,dp1_moe,ep2_moe; tied-weights: "
                        "dp1_tied,dp1_tied_mtp,dp2_tied,dp2_tied_mtp")
    p.add_argument("--configs", default=None, help="default: off,off_repeat,before,after (layouts: before "
                                                   "runs for MoE layouts only)")
    p.add_argument("--strategies-dp1", default="optim_grads_params,no_shard")
    p.add_argument("--strategies-dp2", default="optim_grads_params,no_shard,optim,optim_grads")
    p.add_argument("--baseline", default=str(ROOT / ".baseline"),
                   help="folder holding gemm-patch 0.1.0's gemm_patch/ (git archive 4c56ac3 gemm_patch)")
    p.add_argument("--after-root", default=str(ROOT),
                   help="folder whose gemm_patch/ is the 'after' configuration (default: this checkout; "
                        "a `git archive HEAD gemm_patch` copy pins a commit while others edit the tree)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--per-gpu", type=int, default=4, help="processes sharing one GPU at a time")
    p.add_argument("--deadline", type=float, default=420, help="seconds after which no process starts")
    p.add_argument("--proc-limit", type=float, default=240, help="seconds a process may run")
    p.add_argument("--hard-stop", type=float, default=480,
                   help="seconds after which every process still running is killed and the results are assembled")
    p.add_argument("--loss-floor", type=float, default=1e-4,
                   help="smallest loss tolerance (nats); the tolerance is mostly 3 x noise or 3 x control")
    p.add_argument("--tree-state-file", default=str(ROOT / ".baseline" / "tree_state.txt"),
                   help="text recorded as tree_state (git HEAD and status of the checkout, written before the run)")
    p.add_argument("--dry", action="store_true", help="write the plans and print the commands only")
    p.add_argument("--compare-only", action="store_true", help="skip training; compare what is in scratch")
    args = p.parse_args(argv)
    if args.out is None and not (args.merge_run or args.append_tied_weights):
        p.error("--out is required unless --merge-run or --append-tied-weights is given")
    if args.layouts is None:
        args.layouts = ",".join(LC.SMOKE_LAYOUTS if args.smoke else LC.LAYOUTS) if args.campaign == LC.CAMPAIGN else \
            "dp1_tied,dp1_tied_mtp,dp2_tied,dp2_tied_mtp"
    if args.configs is None:
        args.configs = "off,before,after" if args.smoke else ",".join(CONFIGS)
    if args.smoke:
        args.releases = args.releases.split(",")[-1]
    return args


# -- plans and processes ------------------------------------------------------------------------

def dump_path(scratch: Path, rel: str, layout: str, config: str, what: str, m: int) -> Path:
    return scratch / "dumps" / rel / layout / f"{config}.{what}.m{m}.pt"


def make_processes(args, scratch: Path) -> list[dict[str, Any]]:
    procs = []
    model = {"layers": args.layers, "hidden": args.hidden, "seq": args.seq, "vocab": args.vocab,
             "micro_batch_size": args.micro_batch_size, "lr": args.lr, "main_grads_dtype": "fp32"}
    for rel in args.releases.split(","):
        for layout in args.layouts.split(","):
            lay = LAYOUTS[layout]
            shape = {k: lay[k] for k in ("tied", "mtp_layers", "moe_experts")}
            strategies = (args.strategies_dp1 if lay["gpus"] == 1 else args.strategies_dp2).split(",")
            for config in args.configs.split(","):
                plan = []
                fusion = "off" if config.startswith("off") else "on"
                if fusion == "off":
                    for m in (4, 1):
                        plan.append({**model, **shape, "name": f"{config}.autograd.m{m}", "mode": "autograd",
                                     "fusion": "off", "micro_batches": m, "steps": 1,
                                     "grad_dump": str(dump_path(scratch, rel, layout, config, "autograd", m))})
                for s in strategies:
                    for m, steps in ((4, args.steps), (1, 1)):
                        plan.append({**model, **shape, "name": f"{config}.{s}.m{m}", "mode": "train",
                                     "fusion": fusion, "sharding": s, "micro_batches": m, "steps": steps,
                                     "grad_dump": str(dump_path(scratch, rel, layout, config, s, m))})
                procs.append(process(args, scratch, rel, layout, config, lay["gpus"], plan,
                                     args.baseline if config == "before" else args.after_root))
    # Releases in the order given; in each, 2-GPU processes first (they need both GPUs' slots),
    # then 1-GPU ones; off before the rest.
    order = {c: i for i, c in enumerate(CONFIGS)}
    rels = {r: i for i, r in enumerate(args.releases.split(","))}
    procs.sort(key=lambda p: (rels[p["release"]], -p["gpus"], order.get(p["config"], 9)))
    return procs


def process(args, scratch: Path, rel: str, layout: str, config: str, gpus: int, plan: list[dict],
            gp_root: str | None, extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> dict[str, Any]:
    """One training process: torchrun of train_gpt_fsdp.py over its plan, under ``python -m
    gemm_patch run`` with ``gp_root``'s gemm_patch first on PYTHONPATH for fused configurations
    (before/after), plain for off/off_repeat; ``env`` is added to the process's environment."""
    name = f"{rel}.{layout}.{config}"
    plan_file = scratch / "plans" / f"{name}.json"
    plan_file.write_text(json.dumps(plan, indent=1))
    out = scratch / "parts" / f"{name}.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(gpus), "-m", SCRIPT, "--plan", str(plan_file), "--out", str(out)]
    mc = str(Path(args.mcore_root) / f"mc{rel.replace('.', '')}")
    site = str(Path(args.mcore_root) / "site")
    own = (ROOT, Path(args.baseline).resolve(), Path(args.after_root).resolve())
    rest = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if e and e not in (mc, site) and Path(e).resolve() not in own
            and not Path(e).name.startswith("mc0")]
    if config in ("before", "after"):
        gp_root = str(Path(gp_root).resolve())
        cmd = [sys.executable, "-m", "gemm_patch", "run", "--", *torchrun, "--require-patch", *extra]
        pythonpath = [gp_root, mc, site, *rest, str(CHECKOUT)]
    else:
        gp_root, cmd, pythonpath = None, [*torchrun, *extra], [mc, site, *rest, str(CHECKOUT)]
    return {"name": name, "release": rel, "layout": layout, "config": config,
            "gpus": gpus, "cmd": cmd, "pythonpath": os.pathsep.join(pythonpath),
            "gemm_patch_root": gp_root, "out": str(out), "plan": plan, "env": dict(env or {}),
            "log": str(scratch / "logs" / f"{name}.log")}


def print_dry(procs) -> None:
    for p in procs:
        print(p["name"], "GPUs", p["gpus"], "PYTHONPATH=" + p["pythonpath"],
              *(f"{k}={v}" for k, v in p.get("env", {}).items()), " ".join(p["cmd"]))
        print("   plan:", [r["name"] for r in p["plan"]])


def read_parts(procs) -> dict[str, Any]:
    """Each process's JSON (None where it wrote none)."""
    parts = {}
    for p in procs:
        try:
            parts[p["name"]] = json.loads(Path(p["out"]).read_text())
        except (OSError, ValueError):
            parts[p["name"]] = None
    return parts


def write_logs(path: Path, procs) -> None:
    with gzip.open(path, "wt") as f:
        for p in procs:
            f.write(f"==== {p['name']} rc={p.get('rc')} seconds={p.get('seconds')} {p.get('skipped') or ''} ====\n")
            try:
                f.write(Path(p["log"]).read_text(errors="replace"))
            except OSError:
                f.write("(no log)\n")


def run_processes(procs, args, t0: float) -> None:
    ngpu = 2
    load = [0] * ngpu
    pending, running = list(procs), []
    while pending or running:
        for r in list(running):
            rc = r["popen"].poll()
            elapsed = time.time() - r["start"]
            if rc is None and (elapsed > args.proc_limit or time.time() - t0 > args.hard_stop):
                os.killpg(r["popen"].pid, 9)  # torchrun and its workers: the process group it leads
                r["timed_out"] = True
                rc = r["popen"].wait()
            if rc is not None:
                r["rc"], r["seconds"] = rc, round(time.time() - r["start"], 1)
                if r.get("timed_out"):
                    r["skipped"] = "killed at proc-limit or hard-stop"
                r["logf"].close()
                for g in r["gpu_ids"]:
                    load[g] -= 1
                running.remove(r)
                print(f"[{time.time() - t0:6.1f}s] done {r['name']}: rc={rc} in {r['seconds']} s"
                      f"{' (killed at proc-limit)' if r.get('timed_out') else ''}", flush=True)
        for p in list(pending):
            if time.time() - t0 > args.deadline:
                p["rc"], p["skipped"] = None, f"deadline {args.deadline} s"
                pending.remove(p)
                print(f"skipped {p['name']}: past the deadline", flush=True)
                continue
            if p["gpus"] == 2:
                if max(load) >= args.per_gpu:
                    continue
                gpu_ids = [0, 1]
            else:
                g = min(range(ngpu), key=lambda i: load[i])
                if load[g] >= args.per_gpu:
                    continue
                gpu_ids = [g]
            env = {k: v for k, v in os.environ.items() if k not in ("GEMM_PATCH_TE_OVERWRITE", "GEMM_PATCH_DISABLE")}
            env.update(PROTECT_ENV)
            env.update(p.get("env", {}))
            env.update(PYTHONPATH=p["pythonpath"], CUDA_VISIBLE_DEVICES=",".join(map(str, gpu_ids)),
                       PYTHONUNBUFFERED="1")
            env.pop("GEMM_PATCH_AUTO", None)
            Path(p["log"]).parent.mkdir(parents=True, exist_ok=True)
            p["logf"] = open(p["log"], "w")
            p["popen"] = subprocess.Popen(p["cmd"], env=env, cwd=args.scratch, stdout=p["logf"],
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
            p["start"], p["gpu_ids"] = time.time(), gpu_ids
            p["start_s"] = round(p["start"] - t0, 1)
            for g in gpu_ids:
                load[g] += 1
            pending.remove(p)
            running.append(p)
            print(f"[{time.time() - t0:6.1f}s] start {p['name']} on GPU {gpu_ids}", flush=True)
        time.sleep(0.5)


# -- comparisons --------------------------------------------------------------------------------

def load_dump(path: Path, cache: dict):
    import torch

    key = str(path)
    if key not in cache:
        cache[key] = None
        if path.exists():
            data = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
            cache[key] = data["grads"] if isinstance(data, dict) and "grads" in data else data
    return cache[key]


def rel_ratio(got, ref) -> tuple[float, float]:
    got, ref = got.double(), ref.double()
    n = float(ref.norm())
    d = float((got - ref).norm())
    rel = d / n if n > 0 else (0.0 if d == 0 else float("inf"))
    return rel, (float(got.norm()) / n if n > 0 else float("nan"))


def compare(got: dict, ref: dict, noises: list[tuple[dict, dict]]) -> dict[str, Any]:
    """Per parameter rel and norm ratio of got vs ref; bound max(2^-7, 3 x the largest rel of
    the (a, b) noise pairs for that parameter)."""
    from validation.parity.gpt_model import param_kind

    rows, problems = [], []
    for name in sorted(set(got) | set(ref)):
        if name not in got or name not in ref:
            problems.append(f"{name}: only in {'got' if name in got else 'ref'}")
            continue
        if tuple(got[name].shape) != tuple(ref[name].shape):
            problems.append(f"{name}: shape {tuple(got[name].shape)} vs {tuple(ref[name].shape)}")
            continue
        rel, ratio = rel_ratio(got[name], ref[name])
        noise = max((rel_ratio(a[name], b[name])[0] for a, b in noises if name in a and name in b), default=None)
        bound = max(BOUND, NOISE_FACTOR * noise) if noise is not None else BOUND
        rows.append({"name": name, "kind": param_kind(name), "rel": rel, "ratio": ratio, "noise_rel": noise,
                     "bound": bound, "ok": rel <= bound})
    worst = max(rows, key=lambda r: r["rel"] / r["bound"], default=None)
    by_kind: dict[str, dict[str, Any]] = {}
    for r in rows:
        k = by_kind.setdefault(r["kind"], {"params": 0, "max_rel": 0.0, "min_ratio": float("inf"),
                                           "max_ratio": 0.0, "failed": 0})
        k["params"] += 1
        k["max_rel"] = max(k["max_rel"], r["rel"])
        k["min_ratio"] = min(k["min_ratio"], r["ratio"])
        k["max_ratio"] = max(k["max_ratio"], r["ratio"])
        k["failed"] += not r["ok"]
    failed = [r["name"] for r in rows if not r["ok"]]
    return {
        "params": len(rows),
        "max_rel_diff": max((r["rel"] for r in rows), default=None),
        "worst_param": worst["name"] if worst else None,
        "worst_param_rel": worst["rel"] if worst else None,
        "worst_param_bound": worst["bound"] if worst else None,
        "min_norm_ratio": min((r["ratio"] for r in rows), default=None),
        "max_norm_ratio": max((r["ratio"] for r in rows), default=None),
        "failed": failed,
        "problems": problems,
        "passed": bool(rows) and not failed and not problems,
        "by_kind": by_kind,
        "rows": rows,
    }


def _dmax(a, b):
    if not a or not b or len(a) != len(b):
        return None
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def loss_parity(losses: dict[str, list[float]], floor: float, control: float | None = None) -> dict[str, Any]:
    """Tolerance = max(3 x fusion-off's run-to-run noise, 3 x control, floor). ``control``: the
    untied model's max_step |fused - off| of the same release, GPU count and strategy, run with
    gemm-patch 0.1.0 (right for untied weights): what fusion legitimately changes in the loss
    curve (fused fp32 accumulation instead of one bf16 rounding per micro-batch). Needed because
    fusion-off is bitwise deterministic here (noise 0), and a correct fused run cannot be."""
    off, rep = losses.get("off"), losses.get("off_repeat")
    if not off:
        return {"error": "no fusion-off loss curve"}
    dmax = _dmax
    noise = dmax(rep, off) if rep else None
    tol = max(NOISE_FACTOR * (noise or 0.0), NOISE_FACTOR * (control or 0.0), floor)
    out = {"noise_max_step": noise, "control_max_step": control, "tolerance": tol, "floor": floor,
           "noise_factor": NOISE_FACTOR}
    for c in ("before", "after"):
        if losses.get(c):
            d = dmax(losses[c], off)
            out[c] = {"max_step_diff": d, "last_step_diff": losses[c][-1] - off[-1] if d is not None else None,
                      "passed": d is not None and d <= tol}
    return out


def assemble(procs, args, t0: float) -> dict[str, Any]:
    scratch = Path(args.scratch)
    parts = read_parts(procs)
    cache: dict[str, Any] = {}
    records, rows, details = [], [], {"comparisons": {}, "parts": parts}
    releases = args.releases.split(",")
    # Loss controls: untied layouts' max_step |before - off| (gemm-patch 0.1.0 is right there).
    controls: dict[tuple, float] = {}
    for p in procs:
        if p["config"] != "before" or LAYOUTS[p["layout"]]["tied"] != "off":
            continue
        before, off = parts.get(p["name"]), parts.get(p["name"][: -len("before")] + "off")
        if not before or not off:
            continue
        off_runs = {r["name"].split(".", 1)[1]: r for r in off.get("runs", [])}
        for r in before.get("runs", []):
            key = r["name"].split(".", 1)[1]
            if key.endswith(".m4") and r.get("steps") and off_runs.get(key, {}).get("steps"):
                d = _dmax([x["loss"] for x in r["steps"]], [x["loss"] for x in off_runs[key]["steps"]])
                if d is not None:
                    k = (p["release"], p["gpus"], key[: -len(".m4")], bool(LAYOUTS[p["layout"]]["moe_experts"]))
                    controls[k] = max(controls.get(k, 0.0), d)
    for rel in releases:
        for layout in args.layouts.split(","):
            lay = LAYOUTS[layout]
            strategies = (args.strategies_dp1 if lay["gpus"] == 1 else args.strategies_dp2).split(",")
            runs: dict[str, dict] = {}  # "config.what.mM" -> run record
            versions, init_hashes, grad_dtypes = {}, {}, set()
            for c in args.configs.split(","):
                part = parts.get(f"{rel}.{layout}.{c}")
                if not part:
                    continue
                versions[c] = part.get("versions", {})
                for r in part.get("runs", []):
                    runs[r["name"]] = r
                    if r.get("init_hash"):
                        init_hashes[r["name"]] = r["init_hash"]
                    grad_dtypes.update(r.get("main_grad_buffer_dtypes") or [])
            te = next((v.get("transformer_engine") for v in versions.values() if v), None)
            mcore = next((v.get("megatron_core") for v in versions.values() if v), rel)
            same_init = len(set(init_hashes.values())) <= 1
            for s in strategies:
                for m in (4, 1):
                    def d(config, what=s, m=m, rel=rel, layout=layout):
                        return load_dump(dump_path(scratch, rel, layout, config, what, m), cache)
                    off, off2 = d("off"), d("off_repeat")
                    ag, ag2 = d("off", "autograd"), d("off_repeat", "autograd")
                    rec: dict[str, Any] = {
                        "layout": layout, "strategy": s, "megatron_core": mcore, "release": rel, "te": te,
                        "gpus": lay["gpus"], "micro_batches": m, "moe": bool(lay["moe_experts"]),
                        "tied": lay["tied"] == "on", "mtp_layers": lay["mtp_layers"],
                        "init_hash_agree": same_init, "main_grad_buffer_dtypes": sorted(grad_dtypes),
                        "oracles": {}}
                    for oracle, ref, noises, gots in (
                        ("fusion_off", off, [(off2, off)], ("before", "after", "off_repeat")),
                        ("autograd", ag, [(ag2, ag), (off2, off)], ("before", "after", "off", "off_repeat")),
                    ):
                        if ref is None:
                            rec["oracles"][oracle] = {"missing": "reference dump missing"}
                            continue
                        res = {}
                        for g in gots:
                            got = d(g)
                            if got is None:
                                continue
                            cmp = compare(got, ref, [(a, b) for a, b in noises if a is not None and b is not None])
                            label = f"{rel}.{layout}.{s}.m{m}.{g}_vs_{oracle}"
                            details["comparisons"][label] = cmp
                            res[g] = {k: v for k, v in cmp.items() if k != "rows"}
                            rows.append({"layout": layout, "release": rel, "strategy": s, "micro_batches": m,
                                         "moe": rec["moe"], "config": g, "oracle": oracle,
                                         **{k: cmp[k] for k in ("params", "max_rel_diff", "worst_param",
                                                                "min_norm_ratio", "max_norm_ratio", "passed")}})
                        rec["oracles"][oracle] = res
                    if m == 4:
                        losses, step_ms = {}, {}
                        for c in args.configs.split(","):
                            r = runs.get(f"{c}.{s}.m4")
                            if r and r.get("steps"):
                                losses[c] = [st["loss"] for st in r["steps"]]
                                step_ms[c] = round(r["summary"]["median_step_time_s"] * 1e3, 2)
                        ag_run = runs.get("off.autograd.m4")
                        rec["losses"] = losses
                        rec["median_step_ms"] = step_ms
                        ctrl = controls.get((rel, lay["gpus"], s, bool(lay["moe_experts"])))
                        rec["loss_parity"] = loss_parity(losses, args.loss_floor, ctrl)
                        if ag_run and "off" in losses:
                            rec["step1_loss_autograd_vs_off"] = [ag_run.get("step1_loss"), losses["off"][0]]
                    records.append(rec)
    procs_summary = [{k: p.get(k) for k in ("name", "release", "layout", "config", "gpus", "rc", "seconds",
                                             "start_s", "skipped", "timed_out", "gemm_patch_root", "pythonpath")}
                     for p in procs]
    for p in procs_summary:
        part = parts.get(p["name"])
        if part:
            p["gemm_patch_file"] = part.get("versions", {}).get("gemm_patch_file")
            p["gemm_patch_version"] = part.get("versions", {}).get("gemm_patch")
            p["gemm_patch_targets"] = [(t.get("name"), t.get("state")) for t in
                                       ((part.get("gemm_patch_after_wrap") or {}).get("targets") or [])]
    return {
        "schema": "gemm_patch.coverage/1",
        "campaign": LC.TIED,
        "gemm_patch_sha": {"before": package_sha(Path(args.baseline)), "after": package_sha(Path(args.after_root)),
                           "checkout": package_sha(ROOT)},
        "gemm_patch_roots": {"before": str(Path(args.baseline).resolve()),
                             "after": str(Path(args.after_root).resolve())},
        "tree_state": Path(args.tree_state_file).read_text() if Path(args.tree_state_file).exists() else None,
        "campaign_seconds": round(time.time() - t0, 1),
        "gpu": next((pt.get("gpu") for pt in parts.values() if pt), None),
        "model": {k: getattr(args, k) for k in ("layers", "hidden", "seq", "vocab", "micro_batch_size", "lr",
                                                "steps")},
        "bound": {"base": BOUND, "noise_factor": NOISE_FACTOR,
                  "rule": "per parameter rel = ||g - g_ref|| / ||g_ref|| <= max(2^-7, 3 x noise rel)"},
        "loss_rule": (f"max_step |x - off| <= max(3 x max_step |off - off_repeat|, 3 x control, {args.loss_floor}); "
                      "control = the untied model's max_step |fused (gemm-patch 0.1.0) - off|, same release, "
                      "GPU count, strategy and dense/MoE"),
        "concurrency": f"up to {args.per_gpu} processes share a GPU; step times are contaminated by that",
        "processes": procs_summary,
        "records": records,
        "rows": rows,
    }, details


def package_sha(root: Path) -> str | None:
    """sha256 over gemm_patch/**/*.py under root (path and bytes), to record which code ran."""
    import hashlib

    files = sorted((root / "gemm_patch").rglob("*.py"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def markdown(result: dict[str, Any]) -> str:
    """The short table: one row per (release, layout), aggregated over its strategies and both
    micro-batch counts (every record is in coverage.json)."""
    groups: dict[tuple, list] = {}
    for rec in result["records"]:
        groups.setdefault((rec["release"], rec["layout"]), []).append(rec)

    def agg(recs, config, oracle):
        xs = [(r["oracles"].get(oracle) or {}).get(config) for r in recs]
        xs = [x for x in xs if x]
        if not xs:
            return "-"
        fails = sum(not x["passed"] for x in xs)
        worst = max(x["max_rel_diff"] for x in xs)
        ratio = min(x["min_norm_ratio"] for x in xs)
        verdict = f"{len(xs) - fails}/{len(xs)} pass" if fails else f"{len(xs)}/{len(xs)} pass"
        return f"{worst:.1e}, ratio {ratio:.3f}, {verdict}"

    def loss(recs, config):
        xs = [r.get("loss_parity", {}).get(config) for r in recs if r["micro_batches"] == 4]
        xs = [x for x in xs if x and x.get("max_step_diff") is not None]
        if not xs:
            return "-"
        fails = sum(not x["passed"] for x in xs)
        return f"{max(x['max_step_diff'] for x in xs):.1e} ({len(xs) - fails}/{len(xs)} pass)"

    lines = ["## Tied embeddings and MTP on Megatron-FSDP, before/after gemm-patch's shared-weight fix", "",
             f"{result.get('gpu')} x2, TE 2.20.2, bf16, fp32 main grads; model {result['model']}; "
             f"{len(result['records'])} records ({result['campaign_seconds']:.0f} s of campaign). "
             f"before = gemm-patch 0.1.0 (sha {result['gemm_patch_sha']['before']}), "
             f"after = {result['gemm_patch_sha']['after']} ({(result.get('tree_state') or '').splitlines()[0]}).",
             "", f"Gradient rule: {result['bound']['rule']}, after one step of 4 and of 1 micro-batch, every "
             "parameter's full reduced gradient gathered over ranks. Oracles: fusion_off (the same run with "
             "gradient-accumulation fusion off) and autograd (plain PyTorch autograd without Megatron-FSDP on "
             "the same initial weights and micro-batches, fp32 sum). Cells: worst rel diff, smallest "
             "per-parameter norm ratio, comparisons passing (strategies x {4, 1} micro-batches).", "",
             "| release | layout | strategies | before vs fusion_off | before vs autograd | after vs fusion_off "
             "| after vs autograd | fusion_off vs autograd | loss: before max diff | loss: after max diff "
             "| loss tolerance |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (rel, layout), recs in groups.items():
        strategies = sorted({r["strategy"] for r in recs})
        tols = [r.get("loss_parity", {}).get("tolerance") for r in recs if r["micro_batches"] == 4]
        tols = [t for t in tols if t is not None]
        tol = f"{min(tols):.1e}-{max(tols):.1e}" if tols else "-"
        lines.append(f"| {rel} | {layout} | {len(strategies)} | {agg(recs, 'before', 'fusion_off')} | "
                     f"{agg(recs, 'before', 'autograd')} | {agg(recs, 'after', 'fusion_off')} | "
                     f"{agg(recs, 'after', 'autograd')} | {agg(recs, 'off', 'autograd')} | "
                     f"{loss(recs, 'before')} | {loss(recs, 'after')} | {tol} |")
    failing = sorted({(r["config"], r["worst_param"]) for r in result["rows"] if not r["passed"]})
    if failing:
        lines += ["", "Failing comparisons' worst parameter: " +
                  "; ".join(f"{c}: `{w}`" for c, w in failing) + "."]
    for c in (c for c in result.get("runs", []) if c.get("appended")):  # --append-tied-weights: own before/after
        state = "; ".join((c.get("tree_state") or "").splitlines()[:2])
        lines += ["", f"Run {c['run']} ({', '.join(c.get('releases', []))}: {', '.join(c.get('layouts', []))}): "
                      f"{state}. A configuration without rows here did not run to a gradient dump: its error "
                      "is in the run's logs."]
    lines += ["", f"Loss rule ({result['model']['steps']} steps, 4 micro-batches): {result['loss_rule']}. "
              "fusion_off ran twice per layout and was bitwise identical (noise 0), so the untied models' "
              "fused-vs-off difference is the tolerance's basis.", "",
              "Step times: " + result["concurrency"] + "; they are in coverage.json (`median_step_ms`)."]
    bad = [p for p in result["processes"] if p.get("rc") != 0]
    if bad:
        lines += ["", "### Processes that failed or did not run", ""]
        lines += [f"- {p['name']}: rc={p.get('rc')} {p.get('skipped') or ''}" for p in bad]
    return "\n".join(lines) + "\n"


def compact(obj: Any, key: str = "") -> Any:
    """coverage.json's form: floats to 4 significant digits (loss curves and loss differences
    kept whole: they are compared at 1e-5), empty 'failed'/'problems' lists dropped."""
    if isinstance(obj, float):
        return obj if key in ("losses", "max_step_diff", "last_step_diff", "noise_max_step", "control_max_step",
                              "tolerance", "step1_loss_autograd_vs_off") else float(f"{obj:.4g}")
    if isinstance(obj, dict):
        drop = {"failed", "problems"} if obj.get("passed") is not True else {"failed", "problems", "by_kind"}
        return {k: compact(v, key if key == "losses" else k) for k, v in obj.items()
                if not (k in drop and (v == [] or k == "by_kind"))}
    if isinstance(obj, list):
        return [compact(v, key) for v in obj]
    return obj


def dumps(result: dict[str, Any]) -> str:
    """JSON with one line per top-level key and per element of a top-level list (records, rows,
    processes): diffable, and a third of indent=1's size."""
    parts = []
    for k, v in result.items():
        if isinstance(v, list) and v and isinstance(v[0], dict):
            body = ",\n  ".join(json.dumps(x, separators=(",", ":")) for x in v)
            parts.append(f"{json.dumps(k)}: [\n  {body}\n ]")
        else:
            parts.append(f"{json.dumps(k)}: {json.dumps(v)}")
    return "{\n " + ",\n ".join(parts) + "\n}\n"


LAYOUT_ORDER = {name: i for i, name in enumerate(LAYOUTS)}
RUN_FIELDS = ("campaign_seconds", "gemm_patch_sha", "gemm_patch_roots", "tree_state", "gpu", "model")


def run_summary(res: dict[str, Any], i: int, source: Any) -> dict[str, Any]:
    """One tied-weights run as the merged campaign lists it: its own fields, where it came from and
    the layouts and releases of its records."""
    return {**{k: res.get(k) for k in RUN_FIELDS}, "run": i, "source": str(source),
            "layouts": sorted({r["layout"] for r in res["records"]}),
            "releases": sorted({r["release"] for r in res["records"]})}


def record_key(r: dict[str, Any]) -> tuple:
    return r["release"], r["layout"], r["strategy"], r["micro_batches"]


def sort_key(r: dict[str, Any]) -> tuple:
    """Records and rows in release, layout (LAYOUTS order), strategy, then most micro-batches first."""
    return r["release"], LAYOUT_ORDER.get(r["layout"], 99), r["strategy"], -r["micro_batches"]


def merge(paths: list[str]) -> dict[str, Any]:
    """One result from several runs' coverage.json (each run is self-contained: its own oracles
    and configurations; only whole records move)."""
    merged: dict[str, Any] | None = None
    records: dict[tuple, dict] = {}
    rows: dict[tuple, dict] = {}
    runs = []
    for i, path in enumerate(paths):
        res = json.loads(Path(path).read_text())
        runs.append({**run_summary(res, i, path), "processes": res["processes"]})
        for r in res["records"]:
            records[record_key(r)] = {**r, "run": i}
        for r in res["rows"]:
            rows[(*record_key(r), r["config"], r["oracle"])] = {**r, "run": i}
        # Top-level fields (rules, shas) from the last file: the newest statement of the rules.
        merged = {k: v for k, v in res.items() if k not in ("records", "rows", "processes")}
    assert merged is not None
    merged.update(
        campaign_seconds=sum(c["campaign_seconds"] or 0 for c in runs),
        runs=[{k: v for k, v in c.items() if k != "processes"} for c in runs],
        processes=[{**p, "run": c["run"]} for c in runs for p in c["processes"]],
        records=sorted(records.values(), key=sort_key),
        rows=sorted(rows.values(), key=lambda r: (*sort_key(r), r["config"], r["oracle"])),
    )
    # A process listed by an earlier run whose records were all replaced is kept (its run says so).
    return merged


def append_tied(results: Path, dirs: list[Path]) -> tuple[dict[str, Any], list[dict]]:
    """The results folder's tied-weights campaign with each run in ``dirs`` added as one more run
    (its records replace those of the same key, its processes are appended), and the tied-weights
    rows those runs produced (the releases and layouts of their records)."""
    merged = read_runs(results)[LC.TIED]
    records = {record_key(r): r for r in merged["records"]}
    new_rows: list[dict] = []
    for d in dirs:
        res = json.loads((d / "coverage_runs.json").read_text())[LC.TIED]
        i = len(merged["runs"])
        merged["runs"].append({**run_summary(res, i, d), "appended": True})
        merged["processes"] += [{**p, "run": i} for p in res["processes"]]
        for r in res["records"]:
            records[record_key(r)] = {**r, "run": i}
        groups = {(r["release"], r["layout"]) for r in res["records"]}
        new_rows += [r for r in LC.load_rows(d / "coverage.json")
                     if r.get("campaign") == LC.TIED and (r["release"], r["layout"]) in groups]
    merged["records"] = sorted(records.values(), key=sort_key)
    merged["campaign_seconds"] = sum(c.get("campaign_seconds") or 0 for c in merged["runs"])
    return merged, new_rows


# -- the layouts campaign, and the results folder's files ---------------------------------------------------

def make_layout_processes(args, scratch: Path) -> list[dict[str, Any]]:
    model = {"layers": args.layers, "hidden": args.hidden, "seq": args.seq, "vocab": args.vocab,
             "micro_batch_size": args.micro_batch_size, "lr": args.lr, "main_grads_dtype": "fp32"}
    procs = []
    for rel in args.releases.split(","):
        for layout in args.layouts.split(","):
            for config in LC.configs_for(layout, args.configs.split(",")):
                def dump(config, what, m, rel=rel, layout=layout):
                    return dump_path(scratch, rel, layout, config, what, m)
                plan = LC.plan_for(layout, rel, config, model, dump, args.smoke)
                # 'before': this checkout's gemm_patch without the layout's target, left out from the
                # start through GEMM_PATCH_DISABLE (comma-separated target names).
                env = {"GEMM_PATCH_DISABLE": LC.left_out(layout)} if config == "before" else None
                procs.append(process(args, scratch, rel, layout, config, LC.LAYOUTS[layout]["gpus"], plan,
                                     args.after_root, env=env))
    # Two-GPU processes first (they need a slot on both GPUs), longest plans first.
    procs.sort(key=lambda p: (-p["gpus"], -len(p["plan"])))
    return procs


def read_runs(results: Path) -> dict[str, Any]:
    path = results / "coverage_runs.json"
    if path.exists():
        return json.loads(path.read_text())
    old = results / "coverage.json"  # the tied-weights campaign's own form: one dict, its rows inside
    if old.exists() and isinstance(json.loads(old.read_text()), dict):
        return {LC.TIED: {k: v for k, v in json.loads(old.read_text()).items() if k != "rows"}}
    return {}


def write_results(dest: Path, results: Path, new_rows: list[dict], runs_update: dict[str, Any]) -> list[dict]:
    """dest/coverage.json (every row: results' rows with the new ones merged in), coverage_runs.json
    (each campaign's metadata: the tied-weights campaign's records and processes, the layouts
    campaign's runs) and coverage.md."""
    rows = LC.annotate(LC.merge_rows(LC.load_rows(results / "coverage.json"), new_rows))
    runs = read_runs(results)
    if "layouts_run" in runs_update:
        runs.setdefault(LC.CAMPAIGN, {"runs": []})["runs"].append(runs_update["layouts_run"])
    if LC.TIED in runs_update:
        runs[LC.TIED] = runs_update[LC.TIED]
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "coverage.json").write_text(LC.dumps_rows(compact(rows)))
    body = ",\n".join(f"{json.dumps(k)}: {dumps(compact(v)).rstrip()}" for k, v in runs.items())
    (dest / "coverage_runs.json").write_text("{\n" + body + "\n}\n")
    md = ["# Gradient parity campaigns on H200s (every layout; tied embeddings and MTP)", "",
          "Every comparison is a row of [coverage.json](coverage.json); each campaign's processes, "
          "rules and records are in [coverage_runs.json](coverage_runs.json).", "", LC.markdown(rows)]
    if runs.get(LC.TIED, {}).get("records"):
        md.append(markdown({**runs[LC.TIED], "rows": [r for r in rows if r.get("campaign") == LC.TIED]}))
    (dest / "coverage.md").write_text("\n".join(md))
    try:
        from validation.parity import plot_coverage

        plot_coverage.plot(rows, dest / "coverage_layouts.png")
    except ImportError as exc:  # matplotlib missing (the GPU machine): plotted when merged here
        print(f"no plot: {exc}")
    return rows


def main_layouts(args, t0: float, scratch: Path, out: Path) -> int:
    procs = make_layout_processes(args, scratch)
    if args.dry:
        print_dry(procs)
        return 0
    if not args.compare_only:
        run_processes(procs, args, t0)
    parts = read_parts(procs)
    cache: dict[str, Any] = {}
    rows, details = LC.assemble(procs, parts, lambda *a: dump_path(scratch, *a), lambda path: load_dump(path, cache),
                                 compare, args.smoke)
    run = {
        "smoke": args.smoke, "campaign_seconds": round(time.time() - t0, 1),
        "gemm_patch_sha": package_sha(Path(args.after_root)), "gemm_patch_root": str(Path(args.after_root).resolve()),
        "tree_state": Path(args.tree_state_file).read_text() if Path(args.tree_state_file).exists() else None,
        "gpu": next((pt.get("gpu") for pt in parts.values() if pt), None),
        "versions": sorted({json.dumps(pt.get("versions"), sort_keys=True) for pt in parts.values() if pt}),
        "model": {k: getattr(args, k) for k in ("layers", "hidden", "seq", "vocab", "micro_batch_size")},
        "bound": {"base": BOUND, "noise_factor": NOISE_FACTOR,
                  "rule": "per parameter rel = ||g - g_ref|| / ||g_ref|| <= max(2^-7, 3 x noise rel)"},
        "left_out_in_before": {layout: LC.left_out(layout) for layout in args.layouts.split(",")},
        "processes": [{**{k: p.get(k) for k in ("name", "release", "layout", "config", "gpus", "rc", "seconds",
                                                  "start_s", "skipped", "timed_out")},
                       "targets": [(t.get("name"), t.get("state")) for t in
                                   (((parts.get(p["name"]) or {}).get("gemm_patch_after_wrap") or {}).get("targets")
                                    or [])],
                       "failed_runs": {r["name"]: r.get("unsupported") or r.get("error")
                                       for r in (parts.get(p["name"]) or {}).get("runs", [])
                                       if r.get("unsupported") or r.get("error")}} for p in procs],
    }
    (out / "layouts_rows.json").write_text(LC.dumps_rows(compact(rows)))
    (out / "layouts_run.json").write_text(json.dumps(compact(run), indent=1))
    write_results(out, Path(args.results), rows, {"layouts_run": run})
    with gzip.open(out / "coverage_details_layouts.json.gz", "wt") as f:
        json.dump({"comparisons": details, "parts": parts}, f)
    write_logs(out / "coverage_logs_layouts.txt.gz", procs)
    # Short table last.
    print("\n" + LC.markdown(rows))
    bad = [p["name"] + f" rc={p.get('rc')}" for p in procs if p.get("rc") != 0]
    print(f"processes {len(procs)}, failed/skipped {len(bad)}: {bad}; rows {len(rows)}, passed "
          f"{sum(r.get('passed') is True for r in rows)}, failed {sum(r.get('passed') is False for r in rows)}, "
          f"unsupported {sum(bool(r.get('unsupported')) for r in rows)}; {time.time() - t0:.0f} s")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    if args.merge_run:
        src = Path(args.merge_run)
        new = json.loads((src / "layouts_rows.json").read_text())
        run = json.loads((src / "layouts_run.json").read_text())
        rows = write_results(Path(args.results), Path(args.results), new, {"layouts_run": run})
        print(f"merged {len(new)} rows into {args.results}: {len(rows)} rows")
        return 0
    if args.append_tied_weights:
        runs, rows = append_tied(Path(args.results), [Path(d) for d in args.append_tied_weights])
        write_results(Path(args.results), Path(args.results), rows, {LC.TIED: runs})
        print(f"appended {len(args.append_tied_weights)} runs: {len(runs['records'])} records, {len(rows)} new rows")
        return 0
    if args.merge:
        result = merge(args.merge)
        rows = [{"campaign": LC.TIED, "variant": "", **r} for r in result.pop("rows")]
        write_results(Path(args.out), Path(args.results), rows, {LC.TIED: result})
        print(f"merged {len(args.merge)} files: {len(result['records'])} records, {len(rows)} rows")
        return 0
    scratch = Path(args.scratch)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for sub in ("plans", "parts", "logs", "dumps"):
        (scratch / sub).mkdir(parents=True, exist_ok=True)
    if not args.compare_only:
        for f in list((scratch / "parts").glob("*.json")) + list((scratch / "dumps").rglob("*.pt")):
            f.unlink()
    if args.campaign == LC.CAMPAIGN:
        return main_layouts(args, t0, scratch, out)
    procs = make_processes(args, scratch)
    if args.dry:
        print_dry(procs)
        return 0
    if not args.compare_only:
        run_processes(procs, args, t0)
    else:
        for p in procs:
            p["rc"] = 0 if Path(p["out"]).exists() else None
    result, details = assemble(procs, args, t0)
    tied_rows = [{"campaign": LC.TIED, "variant": "", **r} for r in result.pop("rows")]
    write_results(out, Path(args.results), tied_rows, {LC.TIED: result})
    result["rows"] = tied_rows  # for the table below
    with gzip.open(out / "coverage_details.json.gz", "wt") as f:
        json.dump(details, f)
    write_logs(out / "coverage_logs.txt.gz", procs)
    # Short table last: the verdict per row.
    print("\nrelease layout strategy M config | fusion_off max rel | autograd max rel | pass")
    for rec in result["records"]:
        for c in ("off", "before", "after"):
            fo = (rec["oracles"].get("fusion_off") or {}).get(c)
            au = (rec["oracles"].get("autograd") or {}).get(c)
            if not fo and not au:
                continue
            f1 = f"{fo['max_rel_diff']:.2e}" if fo else "-"
            f2 = f"{au['max_rel_diff']:.2e}" if au else "-"
            ok = all(x["passed"] for x in (fo, au) if x)
            worst = (fo or au)["worst_param"]
            print(f"{rec['release']} {rec['layout']:<14} {rec['strategy']:<18} {rec['micro_batches']} {c:<7}| "
                  f"{f1:>9} | {f2:>9} | {'PASS' if ok else 'FAIL'} {'' if ok else worst}")
    for rec in result["records"]:
        if rec["micro_batches"] == 4 and rec.get("loss_parity"):
            lp = rec["loss_parity"]
            def g(c, lp=lp):
                x = (lp.get(c) or {}).get("max_step_diff")
                return "-" if x is None else f"{x:.2e} {'PASS' if lp[c]['passed'] else 'FAIL'}"
            def f(x):
                return "-" if x is None else f"{x:.1e}"
            print(f"loss {rec['release']} {rec['layout']:<16} {rec['strategy']:<18} "
                  f"noise {f(lp.get('noise_max_step'))} control {f(lp.get('control_max_step'))} "
                  f"tol {f(lp.get('tolerance'))} | before {g('before')} | "
                  f"after {g('after')}")
    failed = [p["name"] for p in result["processes"] if p.get("rc") != 0]
    print(f"processes: {len(procs)}, failed/skipped: {failed}; {result['campaign_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
