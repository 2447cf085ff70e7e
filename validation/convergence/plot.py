"""Validation loss curves from validation/convergence/results.json (nothing else is read).

    python validation/convergence/plot.py [--results FILE] [--png FILE]

One panel per release; one line per convergence run that logged a validation loss (patched,
fusion off per seed, correctness off), in-loop evaluations at their iteration. Runs without a
validation loss (a crash, the speed runs) are listed in the panel's title instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
STYLE = {"patched": ("tab:blue", "-"), "fusion_off": ("tab:orange", "--"),
         "correctness_off": ("tab:red", "-."), "unpatched": ("black", ":")}


def curves(results: dict) -> dict:
    """{release: [(label, config, [(iteration, loss)...]), ...]} for the convergence runs."""
    out: dict = {}
    for r in results["runs"]:
        if r.get("mode", "convergence") != "convergence" or r["config"] == "dry":
            continue
        pts = sorted((int(k), v) for k, v in r["val_loss"].items())
        label = f"{r['config']} seed {r['seed']}"
        out.setdefault(r["release"], []).append((label, r["config"], pts))
    return out


def plot(results: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = curves(results)
    releases = sorted(data)
    fig, axes = plt.subplots(1, max(1, len(releases)), figsize=(6 * max(1, len(releases)), 4.5), squeeze=False)
    for ax, rel in zip(axes[0], releases, strict=False):
        failed = []
        for label, config, pts in sorted(data[rel]):
            if not pts:
                failed.append(label)
                continue
            color, ls = STYLE.get(config, ("gray", "-"))
            if "1235" in label:
                color = "tab:green"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=color, marker=".", label=label)
        title = f"megatron-core {rel}"
        if failed:
            title += "\nno validation loss: " + ", ".join(failed)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylabel("validation lm loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("pretrain_gpt.py, Megatron-FSDP optim_grads_params, fp32 main grads, bf16, 1 GPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=str(HERE / "results.json"))
    ap.add_argument("--png", default=str(HERE / "val_loss.png"))
    a = ap.parse_args(argv)
    with open(a.results) as f:
        plot(json.load(f), a.png)
    print(a.png)


if __name__ == "__main__":
    main()
