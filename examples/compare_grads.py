#!/usr/bin/env python
"""Compare two gradient dumps of examples/train_gpt_fsdp.py --grad-dump, parameter by parameter.

    python examples/compare_grads.py GOT.pt REF.pt [--noise REF2.pt] [--bound 0.0078] [--json OUT]

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
import sys
from typing import Any

DEFAULT_BOUND = 2.0 ** -7

TE_FUSED_SUFFIXES = (".linear_qkv.weight", ".linear_proj.weight", ".linear_fc1.weight",
                     ".linear_fc2.weight")


def param_kind(name: str) -> str:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("got")
    p.add_argument("ref")
    p.add_argument("--noise", help="a second dump of the reference configuration (run-to-run noise)")
    p.add_argument("--bound", type=float, default=DEFAULT_BOUND)
    p.add_argument("--noise-factor", type=float, default=3.0)
    p.add_argument("--json", help="write the full comparison here")
    p.add_argument("--label", default="", help="name recorded in the JSON")
    p.add_argument("--quiet", action="store_true", help="print only the per-kind summary and failures")
    args = p.parse_args(argv)

    result = compare(load(args.got), load(args.ref), load(args.noise) if args.noise else None,
                     args.bound, args.noise_factor)
    result.update(label=args.label, got=args.got, ref=args.ref, noise=args.noise)
    if not args.quiet:
        print(f"{'parameter':<64} {'kind':<15} {'rel diff':>10} {'norm ratio':>10} {'noise':>10}  ok")
        for r in result["rows"]:
            noise = f"{r['noise_rel']:.2e}" if r["noise_rel"] is not None else "-"
            print(f"{r['name']:<64} {r['kind']:<15} {r['rel']:>10.2e} {r['ratio']:>10.4f} {noise:>10}  "
                  f"{'ok' if r['ok'] else 'FAIL'}")
    for kind, k in sorted(result["by_kind"].items()):
        print(f"[{args.label}] {kind:<15} {k['params']:3d} params  max rel {k['max_rel']:.2e}  "
              f"norm ratio {k['min_ratio']:.4f}..{k['max_ratio']:.4f}  failed {k['failed']}")
    for line in result["problems"]:
        print(f"[{args.label}] PROBLEM {line}")
    print(f"[{args.label}] {'PASS' if result['ok'] else 'FAIL'}: {len(result['failed'])} of "
          f"{result['params']} parameters above bound {args.bound:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
