"""validation/convergence/plot.py draws validation/convergence/results.json's convergence runs
(a small fixture here); parse_logs.py reads pretrain_gpt.py's log lines into those records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from validation.convergence import parse_logs, plot

CONV = Path(__file__).resolve().parents[2] / "validation" / "convergence"

FIXTURE = {"runs": [
    {"release": "0.17.1", "mode": "convergence", "config": "patched", "seed": 1234,
     "val_loss": {"100": 2.3, "200": 2.0}, "iterations": 200, "final_val_loss": 1.9},
    {"release": "0.17.1", "mode": "convergence", "config": "fusion_off", "seed": 1235,
     "val_loss": {"100": 2.35, "200": 2.05}},
    {"release": "0.17.1", "mode": "convergence", "config": "unpatched", "seed": 1234, "val_loss": {}},
    {"release": "0.17.1", "mode": "convergence", "config": "dry", "seed": 1234, "val_loss": {"10": 3.0}},
    {"release": "0.19.2", "mode": "speed", "config": "speed_patched", "seed": 1234, "val_loss": {}},
    {"release": "0.19.2", "mode": "moe", "config": "patched", "seed": 1234, "val_loss": {"100": 2.3, "200": 2.1}},
    {"release": "0.19.2", "mode": "moe", "config": "patched", "seed": 1235, "val_loss": {"100": 2.4, "200": 2.2}},
    {"release": "0.19.2", "mode": "moe", "config": "fusion_off", "seed": 1236, "val_loss": {"100": 2.3}},
    {"release": "0.19.2", "mode": "moe", "config": "dry", "seed": 1234, "val_loss": {"10": 3.0}},
]}


def _iteration(it: int, ms: float, loss: str) -> str:
    return (f" [2026-12-01 15:00:00] iteration       {it}/    1000 | consumed samples:          {32 * it} | "
            f"elapsed time per iteration (ms): {ms} | learning rate: 1.0E-04 | global batch size:    32 | "
            f"lm loss: {loss} | loss scale: 1.0 |")


LOG = "\n".join([
    "COMMAND: env GEMM_PATCH=0 python3 -m gemm_patch run -- python3 pretrain_gpt.py --seed 1235",
    _iteration(10, 85.3, "5.123456E+00"),
    "[Rank 0] (after 10 iterations) memory (MB) | allocated: 100.0 | max allocated: 2048.0 | reserved: 3000.0",
    _iteration(20, 80.1, "4.9E+00"),
    " validation loss at iteration 20 | lm loss value: 4.800000E+00 | lm loss PPL: 1.2E+02 |",
    " validation loss at iteration 20 on validation set | lm loss value: 4.700000E+00 | lm loss PPL: 1.2E+02 |",
    "[rank0]: RuntimeError: boom",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    "EXIT: rc=1 seconds=70",
]) + "\n"


def test_curves_keep_convergence_runs():
    c = plot.curves(FIXTURE)
    assert set(c) == {"0.17.1"}
    labels = [label for label, _, _ in c["0.17.1"]]
    assert labels == ["patched seed 1234", "fusion_off seed 1235", "unpatched seed 1234"]
    assert c["0.17.1"][0][2] == [(100, 2.3), (200, 2.0)]


def test_curves_moe_runs():
    c = plot.curves(FIXTURE, "moe")
    assert set(c) == {"0.19.2"}
    assert [label for label, _, _ in c["0.19.2"]] == [
        "patched seed 1234", "patched seed 1235", "fusion_off seed 1236"]
    assert [mode for mode, _, _ in plot.panels(FIXTURE)] == ["convergence", "moe"]


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    res = tmp_path / "results.json"
    res.write_text(json.dumps(FIXTURE))
    png = tmp_path / "val_loss.png"
    plot.main(["--results", str(res), "--png", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = plot.plot(FIXTURE, str(tmp_path / "direct.png"))
    assert [title.split("\n")[0] for title, _, _ in drawn] == [
        "megatron-core 0.17.1, dense", "megatron-core 0.19.2, MoE (8 experts, top-2, grouped GEMM)"]
    assert drawn[0][0].endswith("no validation loss: unpatched seed 1234")
    assert drawn[1][1] == ["fusion_off seed 1236", "patched seed 1234", "patched seed 1235"]
    assert drawn[0][2] == [(200.0, 1.9)] and drawn[1][2] == []  # the quoted final evaluation, where recorded


def test_parse_log():
    r = parse_logs.parse_log(LOG)
    assert r["seed"] == 1235 and r["iterations"] == 20
    assert r["train_loss"] == {"10": 5.123456, "20": 4.9}
    assert r["val_loss"] == {"20": 4.8} and r["final_val_loss"] == 4.7
    assert r["step_ms"] == 80.1 and r["peak_gib"] == 2.0
    assert r["rc"] == 1 and r["error"] == "RuntimeError: boom"
    assert parse_logs.config_of("fusion_off_seed1235") == ("fusion_off", 1235)
    assert parse_logs.config_of("speed_patched_r2") == ("speed_patched", None)
    assert parse_logs.config_of("moe_fusion_off_s1236") == ("fusion_off", 1236)
    assert parse_logs.config_of("moe_dry") == ("dry", None)


def test_parse_dir_moe(tmp_path):
    (tmp_path / "moe_correctness_off_s1236.log").write_text(LOG.replace("--seed 1235", "--seed 1236"))
    (tmp_path / "versions.json").write_text('{"megatron_core": "0.19.2"}')
    [r] = parse_logs.parse_dir(str(tmp_path), "0.19.2", "moe")
    assert (r["mode"], r["run"]) == ("moe", "moe_correctness_off_s1236")
    assert (r["config"], r["seed"]) == ("correctness_off", 1236)
    assert r["versions"] == {"megatron_core": "0.19.2"} and r["final_val_loss"] == 4.7


def test_one_log_of_the_seeds_mode_and_the_pairs(tmp_path):
    for name, final in (("patched_s1236", "4.71"), ("fusion_off_s1236", "4.70"), ("patched_s1237", "4.69"),
                        ("fusion_off_s1237", "4.70")):
        log = LOG.replace("--seed 1235", f"--seed {name[-4:]}").replace("4.700000E+00 | lm loss PPL", f"{final} | lm")
        (tmp_path / f"{name}.log").write_text(log)
        parse_logs.main(["--release", "0.19.2", "--mode", "seeds", "--log", str(tmp_path / f"{name}.log"),
                         "--out", str(tmp_path / f"{name}.json")])
    [r] = json.loads((tmp_path / "patched_s1236.json").read_text())["runs"]
    assert (r["mode"], r["config"], r["seed"], r["final_val_loss"]) == ("seeds", "patched", 1236, 4.71)
    records = [json.loads(p.read_text())["runs"][0] for p in sorted(tmp_path.glob("*.json"))]
    lines = parse_logs.pairs(records)
    assert lines[0] == "0.19.2 seeds seed 1236: patched 4.7100 fusion off 4.7000 diff +0.0100"
    assert lines[-1] == "2 pairs: 1 positive, mean +0.0000, median +0.0000, sign test p = 1.000"
