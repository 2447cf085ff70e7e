"""The tables of docs/validation.md that quote committed records, generated from those records.

    python -m validation.evidence_tables            # rewrite the generated tables in docs/validation.md
    python -m validation.evidence_tables --check    # exit 1 where the doc differs from its records

Each table sits between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``; nothing else of
the doc is touched. validation/tests/test_evidence_tables.py fails when a table is stale.

* ``convergence``: every same-seed pair of final validation losses (validation/convergence/
  results.json and seeds_0.19.2/), gemm-patch against fusion off, with the correctness fixes off
  where that run exists, and the pairs' sign test (parse_logs.pairs).
* ``speed``: gemm-patch against fusion off in every setting of the ``pretrain_gpt.py`` records
  (benchmarks/results/pretrain_gpt_*.jsonl of the list below), as pretrain_gpt_bench's summary computes it.
* ``shapes``: the Llama 3.2 shapes (benchmarks/results/shapes_*.jsonl), every alternative's tokens per
  second, TFLOP/s, step and memory, and the bound (pretrain_gpt_bench.shape_table).
* ``memory-peak``: the runs made with the allocator's history (the shapes', and the hidden-4096
  model's in pretrain_gpt_memory_history_h100.jsonl), where the step's peak falls and what is alive
  there (memory_peak.peak_table).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.memory_peak import peak_table
from benchmarks.pretrain_gpt_bench import read_records, shape_table, summary
from validation.convergence.parse_logs import pairs

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "validation.md"
CONVERGENCE = [ROOT / "validation" / "convergence" / "results.json",
               *sorted((ROOT / "validation" / "convergence" / "seeds_0.19.2").glob("*.json"))]
SPEED = [ROOT / "benchmarks" / "results" / name for name in
         ("pretrain_gpt_h200.jsonl", "pretrain_gpt_pinned_h200.jsonl", "pretrain_gpt_hidden2048_h200.jsonl",
          "pretrain_gpt_embedding_wgrad_h100.jsonl", "pretrain_gpt_untied_h100.jsonl",
          "pretrain_gpt_0.17.1_h100.jsonl", "pretrain_gpt_0.17.1_untied_h100.jsonl",
          "pretrain_gpt_optim_grads_h100.jsonl", "pretrain_gpt_lookup_writer_h100.jsonl",
          "pretrain_gpt_lookup_writer_h200.jsonl", "pretrain_gpt_lookup_writer_profile_h100.jsonl",
          "pretrain_gpt_autograd_fixes_h100.jsonl")]
SHAPES = sorted((ROOT / "benchmarks" / "results").glob("shapes_*.jsonl"))
MEMORY = [*SHAPES, ROOT / "benchmarks" / "results" / "pretrain_gpt_memory_history_h100.jsonl"]
MODEL = {"convergence": "dense", "seeds": "dense", "moe": "MoE"}


def _runs() -> list[dict]:
    return [run for path in CONVERGENCE for run in json.loads(path.read_text())["runs"]]


def convergence_table() -> str:
    runs = _runs()
    final = {(r["release"], r["mode"], r["seed"], r["config"]): r["final_val_loss"] for r in runs
             if r.get("final_val_loss") is not None and r.get("seed")}
    rows = ["| megatron-core, model | seed | gemm-patch | fusion off | difference | correctness fixes off |",
            "|---|---|---|---|---|---|"]
    for (release, mode, seed, config), loss in sorted(final.items()):
        off = final.get((release, mode, seed, "fusion_off"))
        if config != "patched" or off is None:
            continue
        broken = final.get((release, mode, seed, "correctness_off"))
        rows.append(f"| {release}, {MODEL.get(mode, mode)} | {seed} | {loss:.4f} | {off:.4f} | {loss - off:+.4f} | "
                    + (f"{broken:.4f}" if broken is not None else "-") + " |")
    return "\n".join(rows) + "\n\n" + pairs(runs)[-1] + " (difference: gemm-patch - fusion off)\n"


def speed_table() -> str:
    lines = summary([r for path in SPEED for r in read_records(path)]).splitlines()
    header = [h.strip() for h in lines[0].split("|")]
    cells = [dict(zip(header, (c.strip() for c in line.split("|")), strict=True))
             for line in lines[1:] if not line.startswith("FAILED")]
    off = {(c["model"], c["release"], c["tied"], c["setting"]): c for c in cells if c["config"] == "fusion_off"}
    rows = ["| hidden, megatron-core, embeddings | setting | rounds | step, gemm-patch / fusion off (ms, medians) "
            "| ratio | same-round ratio (pairs: range) | vs every correctness fix off, same round "
            "| iteration 1 after another process, gemm-patch (- fusion off) ms "
            "| memory vs fusion off (GiB: allocated, max allocated) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        ref = off.get((c["model"], c["release"], c["tied"], c["setting"]))
        if c["config"] not in ("patched", "patched_baseline") or ref is None:
            continue
        setting = c["setting"] + (", another version's gemm_patch (--baseline-tree)"
                                  if c["config"] == "patched_baseline" else "")
        step = c["step ms (median; each round)"].split(" ")[0]
        ref_step = ref["step ms (median; each round)"].split(" ")[0]
        rows.append(f"| {c['model']}, {c['release']}, {c['tied']} | {setting} | {c['rounds']} | "
                    f"{step} / {ref_step} | {c['vs fusion off']} | {c['same round (pairs: range)']} | "
                    f"{c['vs fixes off, same round']} | {c['iteration 1 ms, after another process (- fusion off)']} | "
                    f"{c['allocated - fusion off']}, {c['max allocated - fusion off']} |")
    return "\n".join(rows) + "\n"


def shapes_table() -> str:
    records = [r for path in SHAPES for r in read_records(path)]
    if not records:
        return "No record of these shapes is committed yet (benchmarks/results/shapes_*.jsonl).\n"
    return shape_table(records)


def memory_peak_table() -> str:
    records = [r for path in MEMORY for r in read_records(path) if r.get("memory_history")]
    if not records:
        return "No run with the allocator's history is committed yet.\n"
    return peak_table(records, top=6)


TABLES = {"convergence": convergence_table, "speed": speed_table, "shapes": shapes_table,
          "memory-peak": memory_peak_table}


def render(doc: str) -> str:
    for name, make in TABLES.items():
        start, end = f"<!-- generated: {name} -->\n", f"<!-- end: {name} -->"
        if doc.count(start) != 1 or doc.count(end) != 1:
            raise SystemExit(f"{DOC.relative_to(ROOT)}: expected one {start.strip()} ... {end} block")
        before, rest = doc.split(start)
        doc = before + start + make() + end + rest.split(end, 1)[1]
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where a table differs from its records")
    args = parser.parse_args(argv)
    current = DOC.read_text()
    fresh = render(current)
    if args.check:
        if fresh != current:
            print(f"{DOC.relative_to(ROOT)} is stale: run python -m validation.evidence_tables")
            return 1
        return 0
    DOC.write_text(fresh)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
