#!/usr/bin/env python
"""Chart of benchmarks/results/e2e_width_h200.json: median step time and peak allocated memory
per configuration, 1 and 2 GPUs, one dot per round.

    python benchmarks/plot_e2e_width.py benchmarks/results/e2e_width_h200.json benchmarks/results/e2e_width_h200.png
"""

from __future__ import annotations

import json
import sys

ORDER = ("fusion_off", "patched", "bf16_grads", "patched_dummy_off", "patched_te_fresh")
LABELS = {"fusion_off": "fusion off\nfp32", "patched": "patched\nfp32", "bf16_grads": "fusion on\nbf16 grads",
          "patched_dummy_off": "patched, dummy\noff (=0.2.0)", "patched_te_fresh": "patched + TE\nper-call dummy"}


def main(src: str, dst: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(open(src).read())["results"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), constrained_layout=True)
    for col, gpus in enumerate(("1", "2")):
        configs = [c for c in ORDER if c in data.get(gpus, {})]
        x = range(len(configs))
        for row, (key, per_round, unit) in enumerate((("median_step_ms", "round_median_step_ms", "ms"),
                                                       ("peak_gib", "peak_gib_per_round", "GiB"))):
            ax = axes[row][col]
            ax.bar(x, [data[gpus][c][key] for c in configs], color="#9ab", width=0.6)
            for i, c in enumerate(configs):
                ax.plot([i] * len(data[gpus][c][per_round]), data[gpus][c][per_round], "k.", ms=5)
                ax.annotate(f"{data[gpus][c][key]:.3g}", (i, data[gpus][c][key]), ha="center",
                            va="bottom", fontsize=8)
            off = data[gpus]["fusion_off"][key]
            ax.axhline(off, color="r", lw=0.8, ls="--", label="fusion off")
            ax.set_xticks(list(x), [LABELS[c] for c in configs], fontsize=8)
            ax.set_ylabel(f"{'median step' if row == 0 else 'peak allocated'} ({unit})")
            low = min(data[gpus][c][key] for c in configs)
            ax.set_ylim(low * 0.9, None)
            ax.set_title(f"{gpus} H200{'s' if gpus == '2' else ''}: {'step time' if row == 0 else 'peak memory'}")
    fig.suptitle("Megatron-FSDP GPT, hidden 4096, FFN 16384, vocab 128256, seq 4096, 4 layers, "
                 "megatron-core 0.17.1, TE 2.20.2 (dots: rounds)", fontsize=10)
    fig.savefig(dst, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
