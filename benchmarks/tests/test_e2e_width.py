"""benchmarks/e2e_width.py's bookkeeping, on the CPU: the round schedule, the merge into the
result's shape, and the committed H200 results file in that shape."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import e2e_width

ROOT = Path(__file__).resolve().parents[2]


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


def test_committed_h200_results_have_the_merged_shape():
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


def _committed() -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / "e2e_width_h200.json").read_text())


def test_committed_wide_model_has_three_rounds_of_each_configuration():
    wide = _committed()["wide"]
    assert wide["model"] == {**e2e_width.MODEL, **e2e_width.WIDE}
    assert wide["flops_per_token"] == e2e_width.flops_per_token(wide["model"])
    assert wide["runs"]["rounds"] == 3 and wide["failed"] == []
    for gpus in ("1", "2"):
        for config in e2e_width.MAIN:
            cell = wide["results"][gpus][config]
            assert cell["rounds"] == 3 and len(cell["round_median_step_ms"]) == 3
            assert cell["median_step_ms"] == sorted(cell["round_median_step_ms"])[1]
            ran = [t for t in wide["tasks"] if t["config"] == config and str(t["gpus"]) == gpus]
            assert sorted(t["round"] for t in ran) == [1, 2, 3]  # each process once: no cut run counted twice
    assert len({t["name"] for t in wide["tasks"]}) == len(wide["tasks"]) == 18


def test_committed_bf16_probe_has_the_shape_of_the_other_probes():
    probes = _committed()["probes"]
    assert set(probes) == {"fusion_off.g2.probe", "patched.g2.probe", "bf16_grads.g2.probe"}
    bf16, patched = probes["bf16_grads.g2.probe"], probes["patched.g2.probe"]
    assert set(bf16) == set(patched) and bf16["rc"] == 0
    assert set(bf16["memory"]) == set(patched["memory"]) and set(bf16["profile"]) == set(patched["profile"])
    assert bf16["memory"]["peak_traced_bytes"] == bf16["memory"]["alive_at_peak_bytes"] > 0
    kernels = [k["kernel"] for k in bf16["profile"]["top_kernels"]]
    assert any("ReduceScatter_Sum_bf16" in k for k in kernels)  # it did reduce bf16 gradients
    assert not any("ReduceScatter_Sum_f32" in k for k in kernels)


def test_merge_counts_a_cut_process_once_its_rerun_completed(tmp_path):
    cut = _task("patched", 2, 1, 1.0, 0.0)
    cut.update(rc=-9, timed_out=True, result={})  # killed before train_gpt_fsdp.py wrote its result
    first, rerun = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"model": e2e_width.MODEL, "tasks": [
        _task("fusion_off", 2, 1, 300.0, 25.9), cut]}))
    rerun.write_text(json.dumps({"model": e2e_width.MODEL, "tasks": [_task("patched", 2, 1, 290.0, 25.9)]}))
    merged = e2e_width.merge([first, rerun])
    assert merged["results"]["2"]["patched"]["rounds"] == 1
    assert merged["results"]["2"]["patched"]["round_median_step_ms"] == [290.0]
    assert [f["rc"] for f in merged["failed"]] == [-9]  # the cut run stays on record as failed
