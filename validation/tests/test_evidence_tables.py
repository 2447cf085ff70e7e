"""docs/validation.md: its generated tables equal what validation/evidence_tables.py makes from the
committed records (a record changed without the doc fails here), no table cell over 400
characters, no history (that is the changelog's)."""

from __future__ import annotations

import json
import re

import pytest

from validation import evidence_tables


def test_generated_tables_match_their_records():
    doc = evidence_tables.DOC.read_text()
    assert evidence_tables.render(doc) == doc, "docs/validation.md is stale: run python -m validation.evidence_tables"


def test_a_changed_record_makes_the_doc_stale(monkeypatch, tmp_path):
    runs = tmp_path / "results.json"
    text = evidence_tables.CONVERGENCE[0].read_text().replace('"final_val_loss": 0.8777', '"final_val_loss": 0.8999', 1)
    runs.write_text(text)
    monkeypatch.setattr(evidence_tables, "CONVERGENCE", [runs, *evidence_tables.CONVERGENCE[1:]])
    doc = evidence_tables.DOC.read_text()
    assert evidence_tables.render(doc) != doc


def test_a_missing_block_is_an_error():
    with pytest.raises(SystemExit, match="expected one <!-- generated: convergence -->"):
        evidence_tables.render("# no tables here\n")


def test_cells_are_short_and_carry_no_history():
    doc = evidence_tables.DOC.read_text()
    cells = [cell for line in doc.splitlines() if line.startswith("|") for cell in line.strip("|").split("|")]
    assert cells and max(map(len, cells)) <= 400, max(cells, key=len)
    history = re.findall(r"supersedes|0\.1\.0 kept|gemm-patch \d\.\d\.\d|before [a-z_]+\.py told", doc)
    assert not history, history


def test_the_speed_table_gives_another_versions_gemm_patch_its_own_row(monkeypatch, tmp_path):
    def record(config: str, rnd: int, ms: float) -> str:
        return json.dumps({"entry": "pretrain_gpt", "release": "0.19.2", "size": "hidden4096", "hidden": 4096,
                           "tied": False, "config": config, "round": rnd, "rc": 0, "step_ms": ms,
                           "step_ms_intervals": [3000.0, 1200.0, ms, ms, ms], "iterations": 20,
                           "allocated_gib": 1.0, "max_allocated_gib": 2.0, "device": "NVIDIA H100 80GB HBM3",
                           "finished": f"2026-12-07T05:0{rnd}:00Z", "seconds": 30.0})
    records = tmp_path / "ab.jsonl"
    records.write_text("\n".join(record(c, rnd, ms + rnd) for rnd in (1, 2, 3) for c, ms in
                                 (("fusion_off", 350.0), ("patched", 330.0), ("patched_baseline", 320.0))) + "\n")
    monkeypatch.setattr(evidence_tables, "SPEED", [records])
    rows = evidence_tables.speed_table().splitlines()[2:]
    assert len(rows) == 2 and "another version's gemm_patch" not in rows[0]
    assert "another version's gemm_patch (--baseline-tree) | 3 | 322.0 / 352.0 | 0.915 |" in rows[1]
