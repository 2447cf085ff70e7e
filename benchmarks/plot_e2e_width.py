#!/usr/bin/env python
"""Chart of benchmarks/results/e2e_width_h200.json: median step time and peak allocated memory
per configuration, 1 and 2 GPUs, for each model run (the base model and, when present, the wide one),
one dot per round.

    python benchmarks/plot_e2e_width.py benchmarks/results/e2e_width_h200.json benchmarks/results/e2e_width_h200.png
"""

from __future__ import annotations

import json
import sys

ORDER = ("fusion_off", "patched", "bf16_grads", "patched_dummy_off", "patched_te_fresh")
LABELS = {"fusion_off": "fusion off\nfp32", "patched": "patched\nfp32", "bf16_grads": "fusion on\nbf16 grads",
          "patched_dummy_off": "patched, dummy\noff (=0.2.0)", "patched_te_fresh": "patched + TE\nper-call dummy"}


def panels(data: dict) -> list[tuple[str, str, dict]]:
    """(title, GPU count, that model's results) per column: the base model, then the wide one if run."""
    out = [(f"hidden {data['model']['hidden']}", g, data["results"]) for g in ("1", "2")]
    if "wide" in data:
        out += [(f"hidden {data['wide']['model']['hidden']}", g, data["wide"]["results"]) for g in ("1", "2")]
    return out


def rounds(results: dict) -> str:
    """'3 rounds' (or '1-3 rounds' where configurations differ), from the results themselves."""
    counts = sorted({cell["rounds"] for cells in results.values() for cell in cells.values()})
    n = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{n} round{'s' if counts[-1] > 1 else ''}"


def main(src: str, dst: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(open(src).read())
    cols = panels(data)
    fig, axes = plt.subplots(2, len(cols), figsize=(6 * len(cols), 7), constrained_layout=True, squeeze=False)
    for col, (model, gpus, results) in enumerate(cols):
        configs = [c for c in ORDER if c in results.get(gpus, {})]
        x = range(len(configs))
        for row, (key, per_round, unit) in enumerate((("median_step_ms", "round_median_step_ms", "ms"),
                                                       ("peak_gib", "peak_gib_per_round", "GiB"))):
            ax = axes[row][col]
            ax.bar(x, [results[gpus][c][key] for c in configs], color="#9ab", width=0.6)
            for i, c in enumerate(configs):
                ax.plot([i] * len(results[gpus][c][per_round]), results[gpus][c][per_round], "k.", ms=5)
                ax.annotate(f"{results[gpus][c][key]:.4g}", (i, results[gpus][c][key]), ha="center",
                            va="bottom", fontsize=8)
            off = results[gpus]["fusion_off"][key]
            ax.axhline(off, color="r", lw=0.8, ls="--", label="fusion off")
            ax.set_xticks(list(x), [LABELS[c] for c in configs], fontsize=8)
            ax.set_ylabel(f"{'median step' if row == 0 else 'peak allocated'} ({unit})")
            low = min(results[gpus][c][key] for c in configs)
            ax.set_ylim(low * 0.9, None)
            what = "step time" if row == 0 else "peak memory"
            ax.set_title(f"{model}, {gpus} H200{'s' if gpus == '2' else ''}: {what}")
    models = [data] + ([data["wide"]] if "wide" in data else [])
    runs = ", ".join(f"hidden {m['model']['hidden']} x {m['model']['layers']} layers ({rounds(m['results'])})"
                     for m in models)
    fig.suptitle(f"Megatron-FSDP GPT, vocab 128256, seq 4096; {runs}; megatron-core 0.17.1, TE 2.20.2 "
                 "(dots: rounds)", fontsize=10)
    fig.savefig(dst, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
