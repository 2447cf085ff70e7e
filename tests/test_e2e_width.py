"""benchmarks/e2e_width.py's bookkeeping (issue 12), on the CPU: the round schedule, the merge into
the issue's result shape, and the committed H200 results file in that shape."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import e2e_width  # noqa: E402


def test_each_configuration_leads_one_round_and_runs_once_per_gpu_count():
    slots = e2e_width.schedule("rounds", 3)
    leaders = [slot[0]["config"] for slot in slots if slot[0]["gpus"] == 1 and len(slot) == 2]
    assert sorted(leaders) == sorted(e2e_width.MAIN)
    for gpus in (1, 2):
        runs = [t["config"] for slot in slots for t in slot if t["gpus"] == gpus]
        assert sorted(runs) == sorted(e2e_width.MAIN * 3)
    assert e2e_width.schedule("round2", 3) == [s for s in slots if s[0]["round"] == 2]


def _task(config: str, gpus: int, rnd: int, ms: float, peak: float) -> dict:
    return {"config": config, "gpus": gpus, "round": rnd, "beside": [], "rc": 0,
            "result": {"median_step_ms": ms, "tokens_per_s": 1000.0 / ms, "peak_gib": peak,
                       "peak_reserved_gib": peak + 1, "main_grad_buffer_dtypes": ["float32"]}}


def test_merge_takes_medians_over_rounds_and_ratios_against_both_references(tmp_path):
    parts = []
    for rnd, (off, patched, bf16) in enumerate(((300.0, 290.0, 280.0), (310.0, 295.0, 281.0),
                                                 (305.0, 400.0, 282.0)), start=1):
        part = tmp_path / f"r{rnd}.json"
        part.write_text(json.dumps({"model": e2e_width.MODEL, "tasks": [
            _task("fusion_off", 2, rnd, off, 25.9), _task("patched", 2, rnd, patched, 25.9),
            _task("bf16_grads", 2, rnd, bf16, 22.0)]}))
        parts.append(part)
    merged = e2e_width.merge(parts)["results"]["2"]
    assert merged["fusion_off"]["median_step_ms"] == 305.0
    assert merged["patched"]["median_step_ms"] == 295.0  # the 400 ms outlier round does not move it
    assert merged["patched"]["step_vs_fusion_off"] == round(295.0 / 305.0, 4)
    assert merged["patched"]["step_vs_bf16_grads"] == round(295.0 / 281.0, 4)
    assert merged["bf16_grads"]["peak_minus_fusion_off_gib"] == round(22.0 - 25.9, 3)
    assert merged["patched"]["rounds"] == 3


def test_committed_h200_results_have_the_issue_shape():
    data = json.loads((ROOT / "benchmarks" / "results" / "e2e_width_h200.json").read_text())
    for gpus in ("1", "2"):
        for config in e2e_width.MAIN:
            cell = data["results"][gpus][config]
            assert cell["median_step_ms"] > 0 and cell["peak_gib"] > 0 and cell["rounds"] >= 3
    versions = data["environment"]["versions"]
    assert versions["megatron_core"] and versions["transformer_engine"] and versions["torch"]
    assert data["gpus"] and "H200" in data["gpus"][0]


def test_bf16probe_adds_one_two_gpu_probe_of_bf16_grads():
    slots = e2e_width.schedule("bf16probe", 3)
    assert slots == [[{"config": "bf16_grads", "gpus": 2, "probe": True}]]
    assert all(t["config"] != "bf16_grads" for slot in e2e_width.schedule("probes", 3) for t in slot)
