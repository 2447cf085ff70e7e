"""Validation loss curves from validation/convergence/results.json (nothing else is read).

    python -m validation.convergence.plot [--results FILE] [--png FILE]

One panel per release of the dense convergence runs, then one per release of the MoE runs (mode
``moe``); one line per run that logged a validation loss (patched, fusion off per seed, correctness
off), in-loop evaluations at their iteration, and a star at the end for the run's final evaluation
(``final_val_loss``, the figure the docs quote: more batches than an in-loop one). Dry runs and
speed runs are not drawn; a run without a validation loss (a crash) is listed in its panel's title
instead. In the MoE panels the colour and line style name the configuration and the marker the seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
STYLE = {"patched": ("tab:blue", "-"), "fusion_off": ("tab:orange", "--"),
         "correctness_off": ("tab:red", "-."), "unpatched": ("black", ":")}
SEED_MARKER = {"1234": "o", "1235": "s", "1236": "^"}
PANEL_MODES = ("convergence", "moe")


def curves(results: dict, mode: str = "convergence") -> dict:
    """{release: [(label, config, [(iteration, loss)...]), ...]} for the runs of one mode."""
    out: dict = {}
    for r in results["runs"]:
        if r.get("mode", "convergence") != mode or r["config"] == "dry":
            continue
        pts = sorted((int(k), v) for k, v in r["val_loss"].items())
        label = f"{r['config']} seed {r['seed']}"
        out.setdefault(r["release"], []).append((label, r["config"], pts))
    return out


def finals(results: dict, mode: str) -> dict:
    """{(release, label): (iterations, final validation loss)} for the runs ``curves`` draws."""
    return {(r["release"], f"{r['config']} seed {r['seed']}"): (r["iterations"], r["final_val_loss"])
            for r in results["runs"] if r.get("mode", "convergence") == mode and r["config"] != "dry"
            and r.get("final_val_loss") is not None and r.get("iterations")}


def panels(results: dict) -> list[tuple[str, str, list]]:
    """[(mode, release, curves), ...]: the dense releases first, then the MoE releases."""
    out = []
    for mode in PANEL_MODES:
        data = curves(results, mode)
        out += [(mode, rel, data[rel]) for rel in sorted(data)]
    return out


def _moe_legends(ax, runs: list) -> None:
    """Two legends, upper right: the configurations (colour, line style) and the seeds (marker)."""
    from matplotlib.lines import Line2D

    configs = sorted({config for _, config, pts in runs if pts})
    seeds = sorted({label.rsplit(" ", 1)[-1] for label, _, pts in runs if pts})
    cfg = ax.legend([Line2D([], [], color=STYLE.get(c, ("gray", "-"))[0], linestyle=STYLE.get(c, ("gray", "-"))[1])
                     for c in configs], configs, fontsize=8, loc="upper right")
    ax.add_artist(cfg)
    ax.legend([Line2D([], [], color="dimgray", marker=SEED_MARKER.get(s, "x"), fillstyle="none", linestyle="none")
               for s in seeds], [f"seed {s}" for s in seeds], fontsize=8, loc="upper right",
              bbox_to_anchor=(0.68, 1.0))


def plot(results: dict, png: str) -> list[tuple[str, list[str]]]:
    """Draw the panels into png; return each panel's title, the labels of its drawn lines and
    its stars (iteration, final validation loss)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    todo = panels(results)
    n = max(1, len(todo))
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.5), squeeze=False)
    drawn = []
    for ax, (mode, rel, runs) in zip(axes[0], todo, strict=False):
        failed = []
        final = finals(results, mode)
        for label, config, pts in sorted(runs):
            if not pts:
                failed.append(label)
                continue
            color, ls = STYLE.get(config, ("gray", "-"))
            if mode == "moe":
                marker = SEED_MARKER.get(label.rsplit(" ", 1)[-1], "x")  # label: "CONFIG seed SEED"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=color, marker=marker,
                        markersize=4, fillstyle="none", label=label)
            else:
                color = "tab:green" if "1235" in label else color
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=color, marker=".", label=label)
            if (rel, label) in final:  # a marker, not a line: the panel's lines stay one per run
                ax.scatter(*final[(rel, label)], marker="*", s=90, color=color, edgecolors="black", zorder=3)
        title = f"megatron-core {rel}, " + ("MoE (8 experts, top-2, grouped GEMM)" if mode == "moe" else "dense")
        if failed:
            title += "\nno validation loss: " + ", ".join(failed)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylabel("validation lm loss")
        ax.grid(alpha=0.3)
        if mode == "moe":
            _moe_legends(ax, runs)
        else:
            ax.legend(fontsize=8)
        stars = [tuple(float(v) for v in xy) for c in ax.collections for xy in c.get_offsets()]
        drawn.append((title, [line.get_label() for line in ax.get_lines()], stars))
    fig.suptitle("pretrain_gpt.py, Megatron-FSDP optim_grads_params, fp32 main grads, bf16, 1 GPU; "
                 "star: the run's final evaluation", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return drawn


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
