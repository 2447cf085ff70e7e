"""The markdown tables of the many-rank records: one row per case.

    python -m validation.shared_gpu.table [validation/results/many_ranks.jsonl]

writes the table beside the records (same name, ``.md``). Gradient parity records (``parity.py``)
give one row per (release, ranks, layout, strategy); memory records (``memory.py``, ``kind:
"memory"``) one row per (release, ranks, configuration). validation/tests/test_shared_gpu_table.py
checks that the committed table is the one these records make.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results" / "many_ranks.jsonl"
LAYOUT_ORDER = ("untied", "tied", "tied_mtp", "moe", "moe_ep", "tied_mtp_fine_gather", "moe_fine_gather")
# The parity model unless a record says otherwise (parity.py's defaults).
DEFAULT_MODEL = {"layers": 2, "hidden": 256, "seq": 256, "vocab": 8192}
STRATEGY_ORDER = ("no_shard", "optim", "optim_grads", "optim_grads_params")
MIB = 2**20


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _index(order: tuple[str, ...], value: str) -> int:
    return order.index(value) if value in order else len(order)


def model_tag(r: dict[str, Any]) -> str:
    """"" for the parity model, else its size (``hidden 1024, vocab 32000, seq 1024, 4 layers``)."""
    model = {**DEFAULT_MODEL, **(r.get("model") or {})}
    if r.get("kind") == "memory" or model == DEFAULT_MODEL:
        return ""
    return f"hidden {model['hidden']}, vocab {model['vocab']}, seq {model['seq']}, {model['layers']} layers"


def sort_key(r: dict[str, Any]) -> tuple:
    return (r.get("kind", "parity"), r["entry"], model_tag(r), tuple(int(x) for x in r["release"].split(".")),
            r["ranks"],
            _index(LAYOUT_ORDER, r.get("layout", "")), _index(STRATEGY_ORDER, r.get("strategy", "")),
            r.get("order") if r.get("order") is not None else -1, r.get("config", ""))


def gpu(r: dict[str, Any]) -> str:
    """The GPU's short name ("H200" of "NVIDIA H200", "H100" of "NVIDIA H100 80GB HBM3")."""
    words = (r.get("device") or "-").replace("NVIDIA ", "").split()
    return words[0] if words else "-"


def case_gpu(by: dict[str, dict[str, Any]]) -> str:
    """The GPU of a case's records; where its configurations ran on different GPUs (a control run
    again later), each configuration's ("H200; upstream H100": gemm-patch's and fusion off's first)."""
    names = {config: gpu(r) for config, r in by.items()}
    main = names.get("patched") or names.get("fusion_off") or next(iter(names.values()), "-")
    others = [f"{config} {name}" for config, name in names.items() if name != main]
    return "; ".join([main, *others])


def _err(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def _vs_reference(r: dict[str, Any]) -> float | None:
    """The error against the record's reference (records made before references had only fusion off)."""
    return r.get("max_rel_err_vs_reference", r.get("max_rel_err_vs_off"))


def parity_verdict(patched: dict[str, Any] | None, upstream: dict[str, Any] | None) -> str:
    """"pass" when gemm-patch is within the bound of the reference, with "(upstream wrong)" where
    the control is outside it and "(reference: no_shard's fusion off)" where fusion off under the
    strategy failed its own check; "FAIL" when gemm-patch is outside; "no result" when it did not run."""
    if patched is None or patched.get("passed") is None:
        return "no result"
    if not patched["passed"]:
        return "FAIL"
    notes = []
    if patched.get("reference") == "fusion_off_no_shard":
        notes.append("reference: no_shard's fusion off")
    err = _vs_reference(upstream) if upstream is not None else None
    if err is not None and err > upstream["bound"]:
        notes.append("upstream wrong")
    return f"pass ({'; '.join(notes)})" if notes else "pass"


def _off_check(off: dict[str, Any] | None) -> str:
    if off is None or off.get("max_rel_err_vs_off_no_shard") is None:
        return "-"
    ratio = off.get("norm_ratio_vs_off_no_shard") or [1.0, 1.0]
    far = max(ratio, key=lambda x: abs(x - 1.0))
    return f"{off['max_rel_err_vs_off_no_shard']:.1e}" + (f" ({far:.2f}x)" if abs(far - 1.0) > 0.01 else "")


def _over(r: dict[str, Any] | None, off: dict[str, Any] | None, key: str) -> str:
    if not r or not off or r.get(key) is None or off.get(key) is None:
        return "-"
    return f"{(r[key] - off[key]) / MIB:+.1f}"


def memory_vs_off(r: dict[str, Any] | None, off: dict[str, Any] | None) -> str:
    """MiB over fusion off: what stays allocated after the step, and the step's max allocated."""
    if not r or not off or off.get("max_allocated_bytes") is None or r.get("max_allocated_bytes") is None:
        return "-"
    if r.get("previous_run") != off.get("previous_run"):
        return "- (order)"  # different runs before: different baselines
    if gpu(r) != gpu(off):
        return "- (other GPU)"  # processes of different machines: no common baseline
    return f"{_over(r, off, 'allocated_bytes')} / {_over(r, off, 'max_allocated_bytes')}"


def parity_markdown(records: Iterable[dict[str, Any]]) -> str:
    """One table per model size; memory columns where the records have it (MiB over fusion off:
    allocated after the step / max allocated, each above what the process's earlier runs left)."""
    tables: dict[str, dict[tuple, dict[str, dict[str, Any]]]] = {}
    for r in sorted(records, key=sort_key):
        tables.setdefault(model_tag(r), {}).setdefault(
            (r["entry"], r["release"], r["ranks"], r["layout"], r["strategy"]), {})[r["config"]] = r
    return "\n".join(_parity_table(tag, cases) for tag, cases in tables.items())


def _parity_table(tag: str, cases: dict[tuple, dict[str, dict[str, Any]]]) -> str:
    # Memory columns only where a record of this table holds memory (older records do not).
    memory = any(r.get("max_allocated_bytes") is not None for by in cases.values() for r in by.values())
    lines = [f"Model: {tag}.", ""] if tag else []
    lines += ["| GPU | release | ranks | case | strategy | gemm-patch vs reference | upstream vs reference "
              "| fusion off vs no_shard's | gemm-patch vs fp64 | off vs fp64 | "
              + ("memory vs fusion off: gemm-patch | upstream | " if memory else "") + "verdict |",
              "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if memory else "") + "---|"]
    for (_, release, ranks, layout, strategy), by in cases.items():
        patched, upstream, off = by.get("patched"), by.get("upstream"), by.get("fusion_off")
        mem = f"{memory_vs_off(patched, off)} | {memory_vs_off(upstream, off)} | " if memory else ""
        lines.append(f"| {case_gpu(by)} | {release} | {ranks} | {layout} | {strategy} | "
                     f"{_err(_vs_reference(patched or {}))} | {_err(_vs_reference(upstream or {}))} | "
                     f"{_off_check(off)} | "
                     f"{_err((patched or {}).get('max_rel_err_vs_fp64'))} | "
                     f"{_err((off or {}).get('max_rel_err_vs_fp64'))} | {mem}{parity_verdict(patched, upstream)} |")
    return "\n".join(lines) + "\n"


def _steps(r: dict[str, Any]) -> str:
    times = " / ".join(f"{t * 1e3:.0f}" for t in r["step_times_s"][:3])
    if r.get("memory_history"):
        return f"{times} (memory history on)"
    return times if r.get("alone") else f"{times} (GPU shared)"


def memory_markdown(records: Iterable[dict[str, Any]]) -> str:
    """Step times count only where the process was alone on the GPU; a run's number in the
    order of the runs alone (``#1`` ran first on the machine's GPU) follows its configuration."""
    lines = ["| release | ranks | case | config | allocated (MiB) | max allocated (MiB) | over fusion off (MiB) "
             "| step 1 / 2 / 3 (ms) |", "|---|---|---|---|---|---|---|---|"]
    rows = sorted(records, key=sort_key)
    off = {(r["release"], r["ranks"], r["case"]): r for r in rows
           if r["config"] == "fusion_off" and "max_allocated_bytes" in r}
    for r in rows:
        config = r["config"] + (f" #{r['order'] + 1}" if r.get("order") is not None else "")
        head = f"| {r['release']} | {r['ranks']} | {r['case']} | {config} |"
        if "max_allocated_bytes" not in r:
            lines.append(f"{head} - | - | - | {r.get('error', 'no result')} |")
            continue
        ref = off.get((r["release"], r["ranks"], r["case"]))
        over = "-" if ref is None or r["config"] == "fusion_off" else \
            f"{(r['max_allocated_bytes'] - ref['max_allocated_bytes']) / MIB:+.1f}"
        lines.append(f"{head} {r['allocated_bytes'] / MIB:.1f} | {r['max_allocated_bytes'] / MIB:.1f} | {over} | "
                     f"{_steps(r)} |")
    return "\n".join(lines) + "\n"


def record_key(r: dict[str, Any]) -> tuple:
    """Records with the same key are one measurement: a newer one replaces an older."""
    if r.get("kind") == "memory":
        return ("memory", r["entry"], r["release"], r["ranks"], r["case"], r["config"], r.get("alone"),
                r.get("order"), bool(r.get("memory_history")))
    return ("parity", r["entry"], model_tag(r), r["release"], r["ranks"], r["layout"], r["strategy"], r["config"])


def markdown(records: list[dict[str, Any]]) -> str:
    parity = [r for r in records if r.get("kind", "parity") == "parity"]
    memory = [r for r in records if r.get("kind") == "memory"]
    parts = ["# Many data-parallel ranks on one GPU (correctness only)", "",
             "Generated by `python -m validation.shared_gpu.table` from "
             "[many_ranks.jsonl](many_ranks.jsonl): max per-parameter relative error of step 1's "
             "reduced gradient; pass = gemm-patch within 2^-7 of the reference. The reference is fusion off "
             "under the same strategy, checked against fusion off under no_shard (all-reduce only; "
             "\"fusion off vs no_shard's\", with the norm ratio where it is off): where that check fails, "
             "the reference is fusion off under no_shard. \"-\" in that column: no_shard itself, or a record "
             "made before the check. Memory: MiB over fusion off, what stays allocated after step 1 / its "
             "max allocated (each the largest over ranks, above what the process's earlier runs left "
             "allocated; the gradient dump's buffers not counted), in the tables whose records hold it; "
             "\"- (order)\": fusion off's process ran another run before this one (the fp64 oracle), so its "
             "baseline is not the same; \"- (other GPU)\": the two ran on different machines. GPU: where a "
             "case's configurations ran on different GPUs, each configuration's.", ""]
    if parity:
        parts += ["## Gradient parity", "", parity_markdown(parity)]
    if memory:
        parts += ["## Memory and first steps (each rank's own, max over ranks)", "", memory_markdown(memory)]
    return "\n".join(parts)


def write(results: Path = RESULTS) -> Path:
    path = Path(results).with_suffix(".md")
    path.write_text(markdown(load(results)))
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(write(Path(args[0]) if args else RESULTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
