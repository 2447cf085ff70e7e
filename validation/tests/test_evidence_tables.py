"""docs/validation.md: its generated tables equal what validation/evidence_tables.py makes from the
committed records (a record changed without the doc fails here), no table cell over 400
characters, no history (that is the changelog's)."""

from __future__ import annotations

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
