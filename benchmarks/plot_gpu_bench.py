"""Chart of benchmarks/gpu_bench.py results: time per method per shape relative to the bf16
GEMM (the line at 1.0).

    python -m benchmarks.plot_gpu_bench benchmarks/results/gpu_bench_h200.json benchmarks/results/gpu_bench_h200.png
"""

from __future__ import annotations

import json
import sys


def main(src: str, dst: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(src))
    rows = data["rows"]
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m not in ("matmul_bf16", "fallback")]
    bar = {tuple(r["shape"]): r["ms"] for r in rows if r["method"] == "matmul_bf16"}
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        ratios = [next(r["ms"] for r in rows if tuple(r["shape"]) == s and r["method"] == method) / bar[s]
                  for s in shapes]
        ax.bar([x + i * width for x in range(len(shapes))], ratios, width, label=method)
    ax.axhline(1.0, color="black", linewidth=1, label="bf16 GEMM (torch.matmul, bf16 out)")
    ax.axhline(1.03, color="grey", linestyle="--", linewidth=1, label="target 1.03x")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))])
    ax.set_xticklabels([f"{t}x{k}->{n}" for t, k, n in shapes], rotation=15)
    ax.set_ylabel("median time / bf16 GEMM time")
    ax.set_ylim(0.8, max(1.6, ax.get_ylim()[1]))
    env = data["env"]
    ax.set_title(f"wgrad into main_grad on {env['gpu']} (torch {env['torch']}, TE {env['transformer_engine']}); "
                 "fallback (12-16x) not shown", fontsize=9)
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
