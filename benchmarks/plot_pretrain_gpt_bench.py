#!/usr/bin/env python
"""Chart of benchmarks/pretrain_gpt_bench.py's records: per model width, the median step time of
each (release, tied/untied, configuration) with one dot per round and its ratio to fusion off of
the same model, and megatron's memory report (allocated between steps, max allocated) with the
difference to fusion off's.

    python -m benchmarks.plot_pretrain_gpt_bench RECORDS.jsonl CHART.png
    python -m benchmarks.plot_pretrain_gpt_bench --tokens RECORDS.jsonl [...] CHART.png
        # the named shapes (Llama 3.2): tokens per second per configuration, one panel per shape
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.pretrain_gpt_bench import LOG_INTERVAL, STEADY_FROM, steady_tokens_per_s

LABELS = {"fusion_off": "fusion off", "patched": "gemm-patch", "bf16_grads": "bf16 grads",
          "bf16_upstream": "bf16 grads,\nmegatron alone",
          "no_shared_grad": "no shared\ngrad fix", "no_te_overwrite": "no TE\noverwrite fix",
          "no_fsdp_dummy_grad": "no FSDP\ndummy grad", "no_te_dummy_wgrad": "no TE\ndummy wgrad",
          "fixes_off": "every fix\noff"}


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


Panel = tuple[str, str, bool, str, int, int | None, str | None]


def shapes(records: list[dict[str, Any]]) -> dict[Panel, dict[str, list[float]]]:
    """(shape, release, tied, GPU, log interval, collector interval, CPU pinning) -> configuration -> tokens/s of
    each finished round, timing runs only (neither the allocator's history nor the profiler): runs of two settings
    never share a bar."""
    out: dict[Panel, dict[str, list[float]]] = {}
    for r in records:
        if (r["rc"] == 0 and steady_tokens_per_s(r) and not r.get("memory_history") and not r.get("profile")
                and not str(r.get("size", "hidden")).startswith("hidden")):
            key = (r["size"], r["release"], r["tied"], r.get("device") or "?", r.get("log_interval", LOG_INTERVAL),
                   r.get("manual_gc_interval"), r.get("cpus"))
            out.setdefault(key, {}).setdefault(r["config"], []).append(steady_tokens_per_s(r))
    return dict(sorted(out.items(), key=lambda item: tuple((v is not None, v or 0) for v in item[0])))  # None first


def tokens_chart(sources: list[str], dst: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for src in sources for line in Path(src).read_text().splitlines() if line.strip()]
    panels = shapes(records)
    if not panels:
        raise SystemExit(f"{', '.join(sources)}: no finished record of a named shape to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7.0, 3.6 * len(panels) + 1), 4.5), squeeze=False,
                             constrained_layout=True)
    order = list(LABELS)
    for ax, ((shape, release, tied, device, interval, gc, cpus), configs) in zip(axes[0], panels.items(), strict=True):
        names = sorted(configs, key=lambda c: order.index(c) if c in order else len(order))
        medians = [statistics.median(configs[c]) for c in names]
        ax.bar(range(len(names)), medians, color=["#d98" if c == "patched" else "#9ab" for c in names], width=0.6)
        for i, c in enumerate(names):
            ax.plot([i] * len(configs[c]), configs[c], "k.", ms=5)
            ax.annotate(f"{medians[i]:,.0f}", (i, medians[i]), ha="center", va="bottom", fontsize=7)
        every = [v for c in names for v in configs[c]]  # every round's dot stays inside the axes
        ax.set_ylim(min(every) * 0.9, max(every) * 1.05)
        ax.set_xticks(range(len(names)), [LABELS.get(c, c).replace("\n", " ") for c in names], fontsize=7,
                      rotation=20)
        ax.set_ylabel(f"tokens per second per GPU, iterations {STEADY_FROM}- (median of rounds)", fontsize=8)
        logged = (f", log every {interval}" if interval != LOG_INTERVAL else "") + (f", gc every {gc}" if gc else "") \
            + (f", cpus {cpus}" if cpus else "")
        ax.set_title(f"{shape}, {'tied' if tied else 'untied'}, megatron-core {release}\n{device}{logged}", fontsize=9)
    fig.suptitle("Megatron-LM pretrain_gpt.py, Megatron-FSDP, one GPU\nfp32 main grads (bf16 grads: bf16); "
                 "dots: rounds", fontsize=10)
    fig.savefig(dst, dpi=100)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tokens"]:
        sys.exit(tokens_chart(sys.argv[2:-1], sys.argv[-1]))
    sys.exit(main(*sys.argv[1:3]))
