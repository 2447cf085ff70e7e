#!/usr/bin/env python
"""Loss-curve PNG and markdown summary of examples/run_e2e.sh's e2e_results.json.

    python examples/plot_e2e.py e2e_results.json --png e2e_loss.png --md e2e_summary.md

Loss parity: the patched run (fusion on, fp32 main grads) against reference (a) (fusion off,
fp32 main grads), per step. The tolerance is 3x the largest per-step difference between (a)
and its repeat (a'), the run-to-run noise of identical configurations, floored at 1e-3 nats
(the loss is logged from bf16 activations; a perfectly deterministic pair would otherwise ask
for bit equality from a run that legitimately rounds differently).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TRAINING = ("patched", "ref_a", "ref_a_repeat", "ref_b", "diag_te_fix_ogp")
LABELS = {
    "patched": "patched: fusion on, fp32 main grads",
    "ref_a": "(a) fusion off, fp32 main grads",
    "ref_a_repeat": "(a') repeat of (a)",
    "ref_b": "(b) fusion on, bf16 main grads",
    "diag_te_fix_ogp": "patched + TE overwrite_main_grad fix",
}
NOISE_FLOOR = 1e-3


def runs_by_name(campaign: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in campaign.get("runs", [])}


def losses(run: dict[str, Any]) -> list[float]:
    return [s["loss"] for s in run["steps"]]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=False)), default=float("nan"))


def parity(runs: dict[str, dict[str, Any]], name: str = "patched") -> dict[str, Any] | None:
    if name not in runs or "ref_a" not in runs:
        return None
    noise = max_abs_diff(losses(runs["ref_a"]), losses(runs["ref_a_repeat"])) if "ref_a_repeat" in runs \
        else float("nan")
    tol = max(3 * noise, NOISE_FLOOR) if noise == noise else NOISE_FLOOR
    diff = max_abs_diff(losses(runs[name]), losses(runs["ref_a"]))
    return {"run": name, "max_abs_diff": diff, "noise": noise, "tolerance": tol, "ok": diff <= tol}


def table(results: dict[str, Any]) -> str:
    out = []
    for key, campaign in sorted(results.get("campaigns", {}).items()):
        runs = runs_by_name(campaign)
        ref_a, ref_b = runs.get("ref_a"), runs.get("ref_b")
        out.append(f"\n### {key.replace('gpu', ' GPU')} ({campaign.get('gpu', '?')}, "
                   f"{campaign['runs'][0]['tokens_per_step']:,} tokens/step)\n")
        out.append("| configuration | median step (ms) | tokens/s | peak mem (GiB) | time vs (a) | "
                   "time vs (b) | mem vs (a) | first → last loss |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---|")
        for name in TRAINING:
            if name not in runs or len(runs[name]["steps"]) < 2:
                continue
            s = runs[name]["summary"]

            def ratio(ref, k, s=s):
                return f"{s[k] / ref['summary'][k]:.3f}" if ref else "-"
            ls = losses(runs[name])
            out.append(f"| {LABELS.get(name, name)} | {s['median_step_time_s'] * 1e3:.1f} | "
                       f"{s['median_tokens_per_s']:,.0f} | {s['peak_mem_bytes'] / 2**30:.2f} | "
                       f"{ratio(ref_a, 'median_step_time_s')} | {ratio(ref_b, 'median_step_time_s')} | "
                       f"{ratio(ref_a, 'peak_mem_bytes')} | {ls[0]:.3f} → {ls[-1]:.3f} |")
        for name in ("patched", "ref_b", "diag_te_fix_ogp"):
            p = parity(runs, name)
            if p:
                out.append(f"\nLoss parity {LABELS.get(name, name)} vs (a): max |Δloss| = "
                           f"{p['max_abs_diff']:.2e} over {len(runs[name]['steps'])} steps; run-to-run "
                           f"noise (a) vs (a') = {p['noise']:.2e}; tolerance {p['tolerance']:.2e} → "
                           f"**{'PASS' if p['ok'] else 'FAIL'}**")
    compares = results.get("grad_compare", {})
    if compares:
        out.append("\n### Gradient parity after step 1 (4 micro-batches), full reduced gradients\n")
        out.append("| comparison | fused by megatron (output layer) | fused by TE | not fused | verdict |")
        out.append("|---|---|---|---|---|")
        for label, c in sorted(compares.items()):
            cells = []
            for kind in ("megatron-fused", "te-fused", "not-fused"):
                k = c["by_kind"].get(kind)
                cells.append(f"rel ≤ {k['max_rel']:.1e}, ratio {k['min_ratio']:.3f}–{k['max_ratio']:.3f}"
                             if k else "-")
            out.append(f"| {label} | {' | '.join(cells)} | {'PASS' if c['ok'] else 'FAIL'} "
                       f"({len(c['failed'])}/{c['params']}) |")
    unpatched = results.get("unpatched", {})
    if unpatched:
        out.append("\n### Unpatched\n")
        for name, u in unpatched.items():
            out.append(f"- {name}: rc={u['rc']}: `{u.get('error')}`")
    return "\n".join(out).lstrip("\n") + "\n"


def plot(results: dict[str, Any], png: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (rerun this script elsewhere on the JSON)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(9, 5.5))
    styles = {"1gpu": "-", "2gpu": "--"}
    for key, campaign in sorted(results.get("campaigns", {}).items()):
        for name, run in runs_by_name(campaign).items():
            if name not in TRAINING or len(run["steps"]) < 2:
                continue
            ax.plot([s["step"] for s in run["steps"]], losses(run), styles.get(key, ":"), marker=".",
                    label=f"{key.replace('gpu', ' GPU')}: {LABELS.get(name, name)}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title("Megatron-FSDP GPT, optim_grads_params, megatron-core 0.17.1 + gemm_patch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=130)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results")
    p.add_argument("--png", default="e2e_loss.png")
    p.add_argument("--md", default=None, help="also write the table here")
    args = p.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    md = table(results)
    print(md)
    if args.md:
        Path(args.md).write_text(md)
    plot(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
