#!/usr/bin/env python
"""Compare two gradient dumps of validation/parity/train_gpt_fsdp.py --grad-dump, parameter by parameter.

    python -m validation.parity.compare_grads GOT.pt REF.pt [--noise REF2.pt] [--bound 0.0078] [--json OUT]
    python -m validation.parity.compare_grads --batch SPEC.txt --out-dir DIR [--prefix 1gpu_]

``--batch``: one comparison per line of SPEC.txt, ``LABEL GOT REF NOISE`` (NOISE ``-`` for
none), all in one process (dumps loaded once, memory-mapped); each result goes to
DIR/compare_<prefix><LABEL>.json; a line whose dump is missing is reported and skipped.

For each parameter: rel = ||g - g_ref|| / ||g_ref|| and ratio = ||g|| / ||g_ref||. A parameter
fails when rel exceeds its bound: ``--bound`` (default 2**-7, see below), raised to
``--noise-factor`` x the run-to-run difference of the reference with itself (``--noise``: a
second dump of the reference configuration) where that is larger. Exit status 1 if any fails.

Why 2**-7: the reference (gradient-accumulation fusion off) rounds each micro-batch's weight
gradient to bf16 before adding it to the fp32 main grad; the fused fp32 path rounds nothing.
One bf16 rounding has relative error at most u = 2**-8 per element (rms about u/sqrt(3) for a
norm), so the two differ by about 2**-9 in norm; 2**-7 (4u) leaves headroom for the
non-deterministic kernels of both runs and stays two orders of magnitude below what a lost
micro-batch does (rel 0.5 and more with 4 micro-batches).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

DEFAULT_BOUND = 2.0 ** -7

TE_FUSED_SUFFIXES = (".linear_qkv.weight", ".linear_proj.weight", ".linear_fc1.weight",
                     ".linear_fc2.weight", ".eh_proj.weight")


def param_kind(name: str) -> str:
    """As train_gpt_fsdp.param_kind: embedding (tied: also the output layer), expert, megatron-fused,
    te-fused, not-fused."""
    if name.endswith("word_embeddings.weight"):
        return "embedding"
    if ".experts." in name and ".weight" in name:
        return "expert"
    if name.endswith("output_layer.weight"):
        return "megatron-fused"
    if name.endswith(TE_FUSED_SUFFIXES):
        return "te-fused"
    return "not-fused"


def load(path: str) -> dict[str, Any]:
    import torch

    data = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    return data["grads"] if isinstance(data, dict) and "grads" in data else data


def relative(got, ref) -> tuple[float, float]:
    got, ref = got.double(), ref.double()
    ref_norm = float(ref.norm())
    diff = float((got - ref).norm())
    rel = diff / ref_norm if ref_norm > 0 else (0.0 if diff == 0 else float("inf"))
    ratio = float(got.norm()) / ref_norm if ref_norm > 0 else float("nan")
    return rel, ratio


def compare(got: dict, ref: dict, noise: dict | None, bound: float, noise_factor: float) -> dict[str, Any]:
    rows, problems = [], []
    for name in sorted(set(got) | set(ref)):
        if name not in got or name not in ref:
            problems.append(f"{name}: only in {'GOT' if name in got else 'REF'}")
            continue
        if tuple(got[name].shape) != tuple(ref[name].shape):
            problems.append(f"{name}: shape {tuple(got[name].shape)} vs {tuple(ref[name].shape)}")
            continue
        rel, ratio = relative(got[name], ref[name])
        noise_rel = relative(noise[name], ref[name])[0] if noise is not None and name in noise else None
        limit = max(bound, noise_factor * noise_rel) if noise_rel is not None else bound
        rows.append({"name": name, "kind": param_kind(name), "rel": rel, "ratio": ratio,
                     "noise_rel": noise_rel, "bound": limit, "ok": rel <= limit})
    failed = [r["name"] for r in rows if not r["ok"]]
    by_kind: dict[str, dict[str, float]] = {}
    for r in rows:
        k = by_kind.setdefault(r["kind"], {"params": 0, "max_rel": 0.0, "min_ratio": float("inf"),
                                           "max_ratio": 0.0, "failed": 0})
        k["params"] += 1
        k["max_rel"] = max(k["max_rel"], r["rel"])
        k["min_ratio"] = min(k["min_ratio"], r["ratio"])
        k["max_ratio"] = max(k["max_ratio"], r["ratio"])
        k["failed"] += not r["ok"]
    return {"ok": not failed and not problems, "bound": bound, "noise_factor": noise_factor,
            "params": len(rows), "failed": failed, "problems": problems, "by_kind": by_kind, "rows": rows}


def report(result: dict[str, Any], label: str, quiet: bool) -> None:
    if not quiet:
        print(f"{'parameter':<64} {'kind':<15} {'rel diff':>10} {'norm ratio':>10} {'noise':>10}  ok")
        for r in result["rows"]:
            noise = f"{r['noise_rel']:.2e}" if r["noise_rel"] is not None else "-"
            print(f"{r['name']:<64} {r['kind']:<15} {r['rel']:>10.2e} {r['ratio']:>10.4f} {noise:>10}  "
                  f"{'ok' if r['ok'] else 'FAIL'}")
    else:
        for r in result["rows"]:
            if not r["ok"]:
                print(f"[{label}] FAIL {r['name']} ({r['kind']}): rel {r['rel']:.2e} ratio {r['ratio']:.4f} "
                      f"bound {r['bound']:.2e}")
    for kind, k in sorted(result["by_kind"].items()):
        print(f"[{label}] {kind:<15} {k['params']:3d} params  max rel {k['max_rel']:.2e}  "
              f"norm ratio {k['min_ratio']:.4f}..{k['max_ratio']:.4f}  failed {k['failed']}")
    for line in result["problems"]:
        print(f"[{label}] PROBLEM {line}")
    print(f"[{label}] {'PASS' if result['ok'] else 'FAIL'}: {len(result['failed'])} of "
          f"{result['params']} parameters above their bound (base {result['bound']:.2e}, "
          f"noise factor {result['noise_factor']})", flush=True)


def run_batch(spec: str, out_dir: str, prefix: str, bound: float, noise_factor: float, quiet: bool) -> int:
    """Every comparison of SPEC; exit status 0 (the verdicts are in the JSON files)."""
    cache: dict[str, dict] = {}

    def get(path: str) -> dict:
        if path not in cache:
            cache[path] = load(path)
        return cache[path]

    os.makedirs(out_dir, exist_ok=True)
    with open(spec) as f:
        lines = [line.split() for line in f if line.strip() and not line.lstrip().startswith("#")]
    for fields in lines:
        if len(fields) != 4:
            print(f"[batch] bad line (want LABEL GOT REF NOISE): {' '.join(fields)}")
            continue
        label, got, ref, noise = fields
        noise = None if noise == "-" else noise
        missing = [x for x in (got, ref) if not os.path.exists(x)]
        if missing:
            print(f"[{prefix}{label}] skipped: dump missing: {' '.join(missing)}", flush=True)
            continue
        if noise is not None and not os.path.exists(noise):
            print(f"[{prefix}{label}] noise dump missing ({noise}): base bound only")
            noise = None
        result = compare(get(got), get(ref), get(noise) if noise else None, bound, noise_factor)
        result.update(label=prefix + label, got=got, ref=ref, noise=noise)
        report(result, prefix + label, quiet)
        with open(os.path.join(out_dir, f"compare_{prefix}{label}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("got", nargs="?")
    p.add_argument("ref", nargs="?")
    p.add_argument("--noise", help="a second dump of the reference configuration (run-to-run noise)")
    p.add_argument("--bound", type=float, default=DEFAULT_BOUND)
    p.add_argument("--noise-factor", type=float, default=3.0)
    p.add_argument("--json", help="write the full comparison here")
    p.add_argument("--label", default="", help="name recorded in the JSON")
    p.add_argument("--quiet", action="store_true", help="print only the per-kind summary and failures")
    p.add_argument("--batch", help="file of comparisons, one per line: LABEL GOT REF NOISE (NOISE '-' for none)")
    p.add_argument("--out-dir", default=".", help="--batch: where compare_<prefix><label>.json go")
    p.add_argument("--prefix", default="", help="--batch: prefix of each label")
    args = p.parse_args(argv)
    if args.batch:
        return run_batch(args.batch, args.out_dir, args.prefix, args.bound, args.noise_factor, args.quiet)
    if not args.got or not args.ref:
        p.error("GOT and REF are required without --batch")

    result = compare(load(args.got), load(args.ref), load(args.noise) if args.noise else None,
                     args.bound, args.noise_factor)
    result.update(label=args.label, got=args.got, ref=args.ref, noise=args.noise)
    report(result, args.label, args.quiet)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
