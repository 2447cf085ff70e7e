#!/usr/bin/env python
"""One step of pretrain_gpt.py's model, every parameter's gradient against fp64: fusion on under
gemm-patch and fusion off, the same initial weights and batch, two runs of each (their run-to-run
noise), on one GPU. Answers whether the fused fp32 path or fusion off is closer to the exact
gradient, parameter by parameter.

    python validation/parity/fp64_step.py --out OUT [--kit /tmp/gp] [--release 0.19.2] [--dry]
    python validation/parity/fp64_step.py --out OUT --compare-only      # the comparison of OUT's dumps again

The model (validation/parity/train_gpt_fsdp.py, megatron-core's GPTModel): the convergence runs' dense
pretrain_gpt.py model (validation/convergence): 4 layers, hidden 512, 8 heads, FFN 2048, sequence 512,
vocabulary 384, tied embedding/output weight, learned absolute position embeddings, TE layers,
Megatron-FSDP optim_grads_params, fp32 main grads, bf16, 4 micro-batches of 8; no dropout (a
gradient oracle needs the same function) and the harness's synthetic tokens instead of text.

Two processes: the reference one (plain torchrun, gemm_patch not loaded): the fp64 oracle
(autograd_oracle.py, ``mode fp64``: megatron's local layers in float64 with the same weights), the
bf16 autograd oracle (fusion off's arithmetic without Megatron-FSDP), fusion off twice; then under
``gemm-patch run`` fusion on twice (``--require-patch``). Each dumps step 1's full gradient (after
the reduction, before the optimizer). Writes OUT/fp64_step.json: per parameter the relative error
||g - g64|| / ||g64|| of every run, per kind and overall (sum over parameters of ||g - g64||^2 over
the sum of ||g64||^2, square-rooted), how many parameters each run is closer on, and the checks:
every run's initial weights equal (``init_hash``), and the bf16 autograd oracle within 0.1 of fp64
on every parameter (otherwise the fp64 model is not the training model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from validation.parity.compare_grads import load, param_kind, relative

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

MODEL = ["--layers", "4", "--hidden", "512", "--seq", "512", "--vocab", "384", "--micro-batch-size", "8",
         "--micro-batches", "4", "--tied", "on", "--position-embedding", "learned_absolute", "--steps", "1",
         "--sharding", "optim_grads_params", "--main-grads-dtype", "fp32", "--seed", "1234"]
REFERENCE = ("fp64", "autograd", "fusion_off", "fusion_off_repeat")
PATCHED = ("patched", "patched_repeat")
COMPARED = ("patched", "patched_repeat", "fusion_off", "fusion_off_repeat", "autograd")
ORACLE_SANITY = 0.1


def plans(out: Path) -> dict[str, list[dict[str, Any]]]:
    def run(name: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": name, "grad_dump": str(out / f"{name}.pt")}
        if name in ("fp64", "autograd"):
            entry.update(mode=name, fusion="off")
        else:
            entry.update(fusion="on" if name.startswith("patched") else "off")
        return entry
    return {"reference": [run(n) for n in REFERENCE], "patched": [run(n) for n in PATCHED]}


def commands(out: Path, python: str) -> list[tuple[str, list[str], dict[str, str]]]:
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                "-m", "validation.parity.train_gpt_fsdp", *MODEL]
    return [("reference", [*torchrun, "--plan", str(out / "plan_reference.json"), "--out",
                           str(out / "reference.json")], {"GEMM_PATCH": "0"}),
            ("patched", [python, "-m", "gemm_patch", "run", "--", *torchrun, "--plan", str(out / "plan_patched.json"),
                         "--out", str(out / "patched.json"), "--require-patch"], {})]


def environment(kit: str | None, release: str, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH")}
    path = [f"{kit}/mc{release.replace('.', '')}", f"{kit}/site", str(ROOT)] if kit else [str(ROOT)]
    env.update(PYTHONPATH=os.pathsep.join(path), NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1", **extra)
    return env


def compare(out: Path) -> dict[str, Any]:
    dumps = {name: load(str(out / f"{name}.pt")) for name in (*REFERENCE, *PATCHED) if (out / f"{name}.pt").exists()}
    if "fp64" not in dumps:
        raise SystemExit(f"{out}/fp64.pt missing: the reference process did not finish")
    exact = dumps["fp64"]
    runs = [n for n in COMPARED if n in dumps]
    rows, totals = [], {n: [0.0, 0.0] for n in runs}
    for name in sorted(exact):
        row: dict[str, Any] = {"name": name, "kind": param_kind(name), "norm": float(exact[name].double().norm())}
        for n in runs:
            row[n] = relative(dumps[n][name], exact[name])[0]
            diff = float((dumps[n][name].double() - exact[name].double()).norm())
            totals[n][0] += diff ** 2
            totals[n][1] += row["norm"] ** 2
        if "patched" in dumps and "fusion_off" in dumps:
            row["patched_vs_fusion_off"] = relative(dumps["patched"][name], dumps["fusion_off"][name])[0]
        rows.append(row)
    kinds = sorted({r["kind"] for r in rows})
    by_kind = {k: {n: {"median": _median([r[n] for r in rows if r["kind"] == k]),
                       "max": max(r[n] for r in rows if r["kind"] == k)} for n in runs} for k in kinds}
    closer = None
    if "patched" in runs and "fusion_off" in runs:
        closer = {"patched": sum(r["patched"] < r["fusion_off"] for r in rows),
                  "fusion_off": sum(r["fusion_off"] < r["patched"] for r in rows), "params": len(rows)}
    records = {}
    for part in ("reference", "patched"):
        path = out / f"{part}.json"
        if path.exists():
            records.update({r["name"]: r for r in json.loads(path.read_text())["runs"]})
    hashes = {n: records[n].get("init_hash") for n in records}
    insane = [r["name"] for r in rows if "autograd" in r and r["autograd"] > ORACLE_SANITY]
    return {"model": MODEL, "runs": runs, "rows": rows, "by_kind": by_kind, "closer": closer,
            "overall": {n: math.sqrt(t[0] / t[1]) for n, t in totals.items()},
            "init_hashes": hashes, "same_initial_weights": len(set(hashes.values())) == 1,
            "oracle_matches_model": not insane, "oracle_mismatch": insane,
            "errors": {n: r.get("error") or r.get("unsupported") for n, r in records.items()
                       if r.get("error") or r.get("unsupported")}}


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    lines = ["relative error against fp64 (||g - g64|| / ||g64||), median / max over the parameters of a kind",
             f"{'kind':<16}" + "".join(f" | {n:>21}" for n in runs)]
    for kind, cells in result["by_kind"].items():
        lines.append(f"{kind:<16}" + "".join(f" | {cells[n]['median']:.3e} / {cells[n]['max']:.3e}" for n in runs))
    lines.append(f"{'overall':<16}" + "".join(f" | {result['overall'][n]:>21.4e}" for n in runs))
    if result["closer"]:
        c = result["closer"]
        lines.append(f"closer to fp64: patched on {c['patched']} of {c['params']} parameters, fusion off on "
                     f"{c['fusion_off']}")
    lines.append(f"same initial weights in every run: {result['same_initial_weights']} {result['init_hashes']}")
    lines.append("bf16 autograd oracle within 0.1 of fp64 everywhere (the fp64 model is the training model): "
                 f"{result['oracle_matches_model']}" + (f" {result['oracle_mismatch']}" if result["oracle_mismatch"]
                                                         else ""))
    lines += [f"FAILED {n}: {e}" for n, e in result["errors"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--kit", help="the GPU kit's folder (/tmp/gp on the H200): KIT/mcXYZ and KIT/site on PYTHONPATH")
    p.add_argument("--release", default="0.19.2", help="megatron-core release in the kit (default 0.19.2)")
    p.add_argument("--python", default="python3")
    p.add_argument("--proc-limit", type=float, default=240.0, help="seconds per process")
    p.add_argument("--dry", action="store_true", help="write the plans, print the commands, run nothing")
    p.add_argument("--compare-only", action="store_true", help="compare the dumps already in OUT")
    a = p.parse_args(argv)
    a.out = a.out.resolve()
    if not a.compare_only:
        a.out.mkdir(parents=True, exist_ok=True)
        for part, plan in plans(a.out).items():
            (a.out / f"plan_{part}.json").write_text(json.dumps(plan, indent=1))
        for part, command, extra in commands(a.out, a.python):
            shown = " ".join([*(f"{k}={v}" for k, v in extra.items()), shlex.join(command)])
            print(f"== {part}: {shown}", flush=True)
            if a.dry:
                continue
            t0 = time.monotonic()
            with open(a.out / f"{part}.log", "w") as log:
                proc = subprocess.Popen(command, env=environment(a.kit, a.release, extra), cwd=a.out, stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
                try:
                    rc = proc.wait(timeout=a.proc_limit)
                except subprocess.TimeoutExpired:  # torchrun and its worker together
                    os.killpg(proc.pid, signal.SIGKILL)
                    rc = proc.wait()
            print(f"== {part}: rc={rc} in {time.monotonic() - t0:.0f} s (log {a.out / f'{part}.log'})", flush=True)
        if a.dry:
            return 0
    result = compare(a.out)
    (a.out / "fp64_step.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    ok = result["same_initial_weights"] and result["oracle_matches_model"] and not result["errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
