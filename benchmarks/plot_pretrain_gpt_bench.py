#!/usr/bin/env python
"""Chart of benchmarks/pretrain_gpt_bench.py's records: per model width, the median step time of
each (release, tied/untied, configuration) with one dot per round and its ratio to fusion off of
the same model, and megatron's memory report (allocated between steps, max allocated) with the
difference to fusion off's.

    python -m benchmarks.plot_pretrain_gpt_bench RECORDS.jsonl CHART.png
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

LABELS = {"fusion_off": "fusion off", "patched": "gemm-patch", "bf16_grads": "bf16 grads",
          "no_shared_grad": "no shared\ngrad fix", "no_te_overwrite": "no TE\noverwrite fix",
          "no_fsdp_dummy_grad": "no FSDP\ndummy grad", "no_te_dummy_wgrad": "no TE\ndummy wgrad"}


def cells(records: list[dict[str, Any]]) -> dict[int, list[tuple[tuple[str, bool, str], list[dict[str, Any]]]]]:
    """hidden -> [((release, tied, config), its finished records)] in the order the chart shows them."""
    out: dict[int, dict[tuple[str, bool, str], list[dict[str, Any]]]] = {}
    for r in records:
        if r["rc"] == 0 and r["step_ms"] is not None and r["allocated_gib"] is not None:
            out.setdefault(r["hidden"], {}).setdefault((r["release"], r["tied"], r["config"]), []).append(r)
    order = list(LABELS)  # pretrain_gpt_bench.CONFIGS' order
    return {h: sorted(group.items(), key=lambda kv: (kv[0][0], not kv[0][1], order.index(kv[0][2])))
            for h, group in sorted(out.items(), reverse=True)}


def main(src: str, dst: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in Path(src).read_text().splitlines() if line.strip()]
    widths = cells(records)
    if not widths:
        raise SystemExit(f"{src}: no finished record to plot")
    counts = [max(3, len(group)) for group in widths.values()]
    fig, axes = plt.subplots(2, len(widths), figsize=(1.1 * sum(counts) + 1, 8), squeeze=False,
                             constrained_layout=True, gridspec_kw={"width_ratios": counts})
    for col, (hidden, group) in enumerate(widths.items()):
        medians = {key: statistics.median(r["step_ms"] for r in rs) for key, rs in group}
        memory = {key: (max(r["allocated_gib"] for r in rs), max(r["max_allocated_gib"] for r in rs))
                  for key, rs in group}
        x = range(len(group))
        labels = [f"{rel} {'tied' if tied else 'untied'}\n{LABELS.get(config, config)}"
                  for (rel, tied, config), _ in group]
        ax = axes[0][col]
        ax.bar(x, [medians[key] for key, _ in group], color="#9ab", width=0.6)
        for i, (key, rs) in enumerate(group):
            ax.plot([i] * len(rs), [r["step_ms"] for r in rs], "k.", ms=5)
            off = medians.get((key[0], key[1], "fusion_off"))
            note = f"{medians[key]:.1f}" + (f"\n{medians[key] / off:.3f}x" if off else "")
            ax.annotate(note, (i, medians[key]), ha="center", va="bottom", fontsize=7)
        ax.set_ylim(min(medians.values()) * 0.85, max(medians.values()) * 1.08)
        ax.set_ylabel("step time, median of rounds (ms)")
        ax.set_title(f"hidden {hidden}: step time\n(dots: rounds; ratio to fusion off)", fontsize=9)
        ax.set_xticks(list(x), labels, fontsize=7)
        ax = axes[1][col]
        for shift, idx, name, color in ((-0.2, 0, "allocated", "#9ab"), (0.2, 1, "max allocated", "#d98")):
            ax.bar([i + shift for i in x], [memory[key][idx] for key, _ in group], width=0.4, color=color, label=name)
        for i, (key, _) in enumerate(group):
            off = memory.get((key[0], key[1], "fusion_off"))
            if off and key[2] != "fusion_off":
                ax.annotate(f"{memory[key][0] - off[0]:+.2f}\n{memory[key][1] - off[1]:+.2f}", (i, max(memory[key])),
                            ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, max(max(m) for m in memory.values()) * 1.15)
        ax.set_ylabel("GiB (megatron's memory report)")
        ax.set_title(f"hidden {hidden}: memory after the last iteration\n(numbers: minus fusion off)", fontsize=9)
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.legend(fontsize=7, loc="lower right")
    sample = records[0]
    fig.suptitle(f"Megatron-LM pretrain_gpt.py, Megatron-FSDP optim_grads_params, fp32 main grads, bf16, TE, "
                 f"{sample['layers']} layers, one GPU, one process at a time", fontsize=10)
    fig.savefig(dst, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
