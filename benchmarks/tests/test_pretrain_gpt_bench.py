"""benchmarks/pretrain_gpt_bench.py on the CPU: the plan and its turning order, the commands
(--dry), and the records it appends as each process finishes, against the fake pretrain_gpt.py
(tests/probes/fake_pretrain.py) under the real ``gemm-patch run``; the chart where matplotlib is
installed."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from benchmarks import pretrain_gpt_bench as bench

ROOT = Path(__file__).resolve().parents[2]

FAKE = ROOT / "tests" / "probes" / "fake_pretrain.py"


def test_the_full_plan_is_the_issue_set_and_the_order_turns_each_round():
    full = bench.cells("full")
    assert len(full) == 15 and len(set(full)) == 15
    assert {c for r, t, c in full if r == "0.19.2" and t} == set(bench.CONFIGS) - {"bf16_upstream", "patched_baseline"}
    assert {(r, t, c) for r, t, c in full if r == "0.17.1"} == {
        ("0.17.1", t, c) for t in (True, False) for c in ("fusion_off", "patched")}
    assert bench.cells("0.19.2:*:patched,core") == [("0.19.2", True, "patched"), ("0.19.2", False, "patched"),
                                                     ("0.19.2", True, "fusion_off")]
    two = bench.cells("core")
    assert [cell[2] for _, cell in bench.schedule(two, 3)] == ["fusion_off", "patched", "patched", "fusion_off",
                                                               "fusion_off", "patched"]
    later = bench.schedule(two, 2, first=4)
    assert [(r, cell[2]) for r, cell in later] == [(4, "patched"), (4, "fusion_off"), (5, "fusion_off"),
                                                   (5, "patched")]
    with pytest.raises(SystemExit, match="matches no cell"):
        bench.cells("0.19.2:tied:no_such_config")


def test_dry_prints_each_command(capsys):
    assert bench.main(["--dry", "--plan", "0.17.1:untied:fusion_off,0.19.2:tied:no_shared_grad", "--rounds", "1",
                       "--upstream", "/up"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# hidden4096_0.17.1_untied_fusion_off_r1"
    off, fix = out[1], out[3]
    assert off.startswith("cd /up/0.17.1 && GEMM_PATCH=0 python3 -m gemm_patch run -- python3 -m torch.distributed.run")
    assert "--vocab-size 128255 " in off  # 0.17.x's NullTokenizer adds one: 128256 in the model
    assert off.endswith("--untie-embeddings-and-output-weights --no-gradient-accumulation-fusion")
    assert fix.startswith("cd /up/0.19.2 && GEMM_PATCH_SHARED_GRAD=0 python3 -m gemm_patch run -- ")
    assert "--vocab-size 128256 " in fix and "untie" not in fix
    assert "--train-iters 30 " in fix and "--log-interval 5 --log-throughput --log-memory-interval 30 " in fix
    assert bench.main(["--dry", "--size", "hidden2048", "--plan", "core", "--rounds", "1"]) == 0
    h2048 = capsys.readouterr().out
    assert "--hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 --seq-length 2048" in h2048
    assert "--micro-batch-size 2 --global-batch-size 8 --train-iters 100 " in h2048 and "--vocab-size 384 " in h2048



def test_every_iteration_logged_and_checked_against_iters(capsys):
    assert bench.main(["--dry", "--size", "hidden2048", "--plan", "core", "--rounds", "1", "--iters", "6",
                       "--log-interval", "1"]) == 0
    out = capsys.readouterr().out
    assert "--train-iters 6 " in out and "--log-interval 1 --log-throughput --log-memory-interval 6 " in out
    with pytest.raises(SystemExit):
        bench.main(["--dry", "--size", "hidden2048", "--plan", "core", "--iters", "6"])  # 6 is no multiple of 5
    assert "multiple of --log-interval 5" in capsys.readouterr().err


def test_flags_of_releases_without_megatron_fsdp_main_grads_dtype():
    """0.14-0.15 reject --megatron-fsdp-main-grads-dtype and --log-memory-interval (argparse exits);
    their fp32 main grads come from --main-grads-dtype."""
    size = bench.SIZES["hidden2048"]
    old = bench.pretrain_args("0.15.3", size, True, 6)
    assert "--megatron-fsdp-main-grads-dtype" not in old and "--log-memory-interval" not in old
    assert old[old.index("--main-grads-dtype") + 1] == "fp32"
    assert old[old.index("--vocab-size") + 1] == "4095"  # its mock token ids reach 4095; the EOD id is added
    new = bench.pretrain_args("0.17.1", size, True, 6)
    assert new[new.index("--megatron-fsdp-main-grads-dtype") + 1] == "fp32" and "--main-grads-dtype" not in new
    assert new[new.index("--log-memory-interval") + 1] == "6"

@pytest.fixture
def upstream(tmp_path, monkeypatch):
    for release in bench.RELEASES:
        (tmp_path / "up" / release).mkdir(parents=True)
        shutil.copy(FAKE, tmp_path / "up" / release / "pretrain_gpt.py")
    monkeypatch.setenv("FAKE_PRETRAIN_ARGV", str(tmp_path / "argv.jsonl"))
    return tmp_path


def run_bench(tmp: Path, plan: str, *extra: str) -> tuple[int, list[dict]]:
    out = tmp / "records.jsonl"
    code = bench.main(["--out", str(out), "--plan", plan, "--rounds", "1", "--iters", "10", "--python",
                       sys.executable, "--launcher", "{python}", "--upstream", str(tmp / "up"), *extra])
    return code, bench.read_records(out)


def test_each_process_appends_its_record(upstream, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_PRETRAIN", "memory")  # the fused runs hold 1002 MB more
    code, records = run_bench(upstream, "0.19.2:tied:fusion_off,0.19.2:tied:patched,0.19.2:untied:no_te_dummy_wgrad,"
                                        "0.17.1:tied:bf16_grads")
    assert code == 0
    assert [(r["release"], r["tied"], r["config"]) for r in records] == [
        ("0.19.2", True, "fusion_off"), ("0.19.2", True, "patched"), ("0.19.2", False, "no_te_dummy_wgrad"),
        ("0.17.1", True, "bf16_grads")]
    off, patched, fix, bf16 = records
    for r in records:
        assert r["entry"] == "pretrain_gpt" and r["hidden"] == 4096 and r["vocab"] == 128256 and r["round"] == 1
        assert r["iterations"] == 10 and r["rc"] == 0 and r["error"] is None and r["memory_after"] == 10
    assert off["step_ms"] == 301.5 and patched["step_ms"] == 296.5  # medians of the lines after iteration 1
    assert off["allocated_gib"] == round(323.11 / 1024, 4)
    assert patched["allocated_gib"] == round((323.11 + 1002) / 1024, 4)
    assert patched["max_allocated_gib"] == round((679.93 + 1002) / 1024, 4)
    assert off["env"] == {"GEMM_PATCH": "0"} and fix["env"] == {"GEMM_PATCH_TE_DUMMY_WGRAD": "0"}
    assert bf16["command"].endswith("--megatron-fsdp-main-grads-dtype bf16")
    seen = [json.loads(line) for line in (upstream / "argv.jsonl").read_text().splitlines()]
    assert [(s["fused"], s["patched"]) for s in seen] == [(False, False), (True, True), (True, True), (True, True)]
    assert seen[2]["argv"][-1] == "--untie-embeddings-and-output-weights"
    assert seen[3]["argv"][seen[3]["argv"].index("--vocab-size") + 1] == "128255"
    table = capsys.readouterr().out
    line = next(x for x in table.splitlines() if x.startswith("4096 | 0.19.2 | tied | patched"))
    cols = [c.strip() for c in line.split("|")]
    del cols[9]  # iteration 1 after another process: these fake processes' timing decides it
    assert cols[:-1] == ["4096", "0.19.2", "tied", "patched", "1", "296.5 (296.5)", "0.983", "0.983 (1)", "-", "-",
                         "1.294", "1.643", "+0.979", "+0.979"]


def test_resume_runs_only_what_this_gpu_has_not_finished(upstream, capsys):
    code, records = run_bench(upstream, "core")
    assert code == 0 and [r["config"] for r in records] == ["fusion_off", "patched"]
    out = upstream / "records.jsonl"
    failed = {**records[1], "rc": 1, "step_ms": None}
    elsewhere = {**records[0], "config": "fixes_off", "device": "NVIDIA H200"}  # another GPU's record
    out.write_text("".join(json.dumps(r) + "\n" for r in (records[0], failed, elsewhere)))
    capsys.readouterr()
    code, records = run_bench(upstream, "core,0.19.2:tied:fixes_off", "--resume")
    assert code == 0
    assert [(r["config"], r["rc"]) for r in records[3:]] == [("patched", 0), ("fixes_off", 0)]
    assert "fusion_off_r1: recorded in" in capsys.readouterr().out
    code, records = run_bench(upstream, "core,0.19.2:tied:fixes_off", "--resume", "--note", "another build")
    assert code == 0 and len(records) == 8  # records of another note are not this run's


def test_a_failed_process_is_recorded_with_its_error(upstream, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_PRETRAIN", "crash_fused")
    code, (rec,) = run_bench(upstream, "0.19.2:tied:patched")
    assert code == 1
    assert rec["rc"] == 3 and rec["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert "FAILED 0.19.2 tied patched round 1: rc=3" in capsys.readouterr().out


def test_chart(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plot_pretrain_gpt_bench as plot

    base = {"entry": "pretrain_gpt", "release": "0.19.2", "hidden": 4096, "layers": 4, "rc": 0}
    records = [{**base, "tied": tied, "config": config, "round": rnd, "step_ms": ms + rnd,
                "allocated_gib": gib, "max_allocated_gib": gib + 5}
               for rnd in (1, 2, 3)
               for tied, config, ms, gib in ((True, "fusion_off", 324.0, 22.7), (True, "patched", 316.0, 22.7),
                                             (False, "fusion_off", 338.0, 31.5), (False, "patched", 331.0, 31.5))]
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot.main(str(src), str(tmp_path / "chart.png")) == 0
    assert (tmp_path / "chart.png").stat().st_size > 10_000


def test_the_tokens_chart_keeps_settings_apart_and_leaves_out_profiled_runs():
    from benchmarks import plot_pretrain_gpt_bench as plot

    records = [rec("patched", 1, 700.0), rec("patched", 2, 710.0, log_interval=1, step_ms_intervals=[710.0] * 20),
               rec("patched", 3, 900.0, profile={"steps": 2}), rec("patched", 4, 950.0, memory_history=True),
               rec("patched", 5, 720.0, manual_gc_interval=100), rec("patched", 6, 730.0, cpus="0-7")]
    panels = plot.shapes(records)
    assert [key[4:] for key in panels] == [(1, None, None), (bench.LOG_INTERVAL, None, None),
                                           (bench.LOG_INTERVAL, None, "0-7"), (bench.LOG_INTERVAL, 100, None)]
    assert [len(configs["patched"]) for configs in panels.values()] == [1, 1, 1, 1]


def test_compare_runs_gemm_patch_compare_on_pretrain_gpt(upstream, capsys):
    out = upstream / "out" / "records.jsonl"
    code = bench.main(["--compare", "--out", str(out), "--plan", "0.19.2:tied:*", "--iters", "10", "--python",
                       sys.executable, "--launcher", "{python}", "--upstream", str(upstream / "up")])
    assert code == 0
    record = json.loads((upstream / "out" / "compare_hidden4096_0.19.2_tied.json").read_text())
    assert record["verdict"] == "same" and [r["iteration"] for r in record["rows"]] == list(range(1, 11))
    assert record["runs"]["off"]["command"][-1] == "--no-gradient-accumulation-fusion"
    text = (upstream / "out" / "compare_hidden4096_0.19.2_tied.txt").read_text()
    assert "verdict: same" in text and "verdict: same" in capsys.readouterr().out


def test_summary_pairs_a_round_only_within_its_time_window():
    def rec(config: str, rnd: int, ms: float, finished: str) -> dict:
        return {"hidden": 4096, "release": "0.19.2", "tied": True, "config": config, "round": rnd, "rc": 0,
                "step_ms": ms, "allocated_gib": 22.0, "max_allocated_gib": 27.0, "error": None,
                "finished": finished}
    records = [rec("fusion_off", 1, 400.0, "2026-12-02T03:00:00Z"), rec("patched", 1, 380.0, "2026-12-02T03:01:00Z"),
               rec("fusion_off", 2, 300.0, "2026-12-02T03:02:00Z"),
               rec("patched", 2, 294.0, "2026-12-02T09:00:00Z")]  # round 2's pair: hours apart
    line = next(x for x in bench.summary(records).splitlines() if "| patched |" in x)
    cols = [c.strip() for c in line.split("|")]
    assert cols[6] == f"{337.0 / 350.0:.3f}"  # the ratio of the medians
    assert cols[7] == "0.950 (1)"  # round 1 only


def test_manual_gc_and_cpus_are_passed_recorded_and_kept_apart_in_the_summary(upstream, capsys):
    assert bench.main(["--dry", "--size", "hidden2048", "--plan", "core", "--rounds", "1", "--manual-gc", "100"]) == 0
    dry = capsys.readouterr().out
    assert "--seed 1234 --manual-gc --manual-gc-interval 100 --no-gradient-accumulation-fusion" in dry
    assert bench.main(["--dry", "--plan", "core", "--rounds", "1", "--cpus", "0-7"]) == 0
    assert "&& GEMM_PATCH=0 taskset -c 0-7 python3 -m gemm_patch run -- " in capsys.readouterr().out
    code, records = run_bench(upstream, "core", "--manual-gc", "100")
    assert code == 0 and [r["manual_gc_interval"] for r in records] == [100, 100]
    argv = [json.loads(line)["argv"] for line in (upstream / "argv.jsonl").read_text().splitlines()]
    assert all(a[a.index("--manual-gc") + 1:a.index("--manual-gc") + 3] == ["--manual-gc-interval", "100"]
               for a in argv)

    def rec(config: str, rnd: int, ms: float, gc: int | None) -> dict:
        return {"hidden": 2048, "release": "0.19.2", "tied": True, "config": config, "round": rnd, "rc": 0,
                "step_ms": ms, "allocated_gib": 3.5, "max_allocated_gib": 4.8, "error": None,
                "finished": f"2026-12-02T03:0{rnd}:00Z", "manual_gc_interval": gc}
    lines = bench.summary([rec("fusion_off", 1, 200.0, None), rec("patched", 1, 150.0, None),
                           rec("fusion_off", 1, 100.0, 100), rec("patched", 1, 99.0, 100),
                           rec("fusion_off", 2, 100.0, 100), rec("patched", 2, 101.0, 100)]).splitlines()
    auto, manual = ([c.strip() for c in x.split("|")] for x in lines if "| patched |" in x)
    assert auto[7] == "0.750 (1)" and auto[-1] == "gc auto"
    assert manual[6] == "1.000" and manual[7] == "1.000 (2: 0.990-1.010)" and manual[-1] == "gc every 100"


def test_summary_of_a_file_that_is_not_records_says_so(tmp_path):
    table = tmp_path / "table.txt"
    table.write_text("hidden | release | tied\n")
    with pytest.raises(SystemExit, match="line 1 is not a JSON record"):
        bench.main(["--summary", str(table)])


def test_the_gpu_is_recorded_and_runs_on_different_gpus_are_summarised_apart(tmp_path, monkeypatch):
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    assert bench.gpu_name() == "NVIDIA H100 80GB HBM3"
    smi.write_text("#!/bin/sh\nexit 9\n")
    assert bench.gpu_name() is None

    def rec(config: str, ms: float, device: str) -> dict:
        return {"hidden": 4096, "release": "0.17.1", "tied": False, "config": config, "round": 1, "rc": 0,
                "step_ms": ms, "allocated_gib": 31.5, "max_allocated_gib": 36.7, "error": None,
                "finished": "2026-12-02T03:00:00Z", "device": device}
    lines = bench.summary([rec("fusion_off", 350.0, "NVIDIA H200"), rec("patched", 343.0, "NVIDIA H200"),
                           rec("fusion_off", 500.0, "NVIDIA H100 80GB HBM3"),
                           rec("patched", 505.0, "NVIDIA H100 80GB HBM3")]).splitlines()
    h100, h200 = ([c.strip() for c in x.split("|")] for x in lines if "| patched |" in x)
    assert h200[6] == "0.980" and h200[-1] == "gc auto, NVIDIA H200"
    assert h100[6] == "1.010" and h100[-1] == "gc auto, NVIDIA H100 80GB HBM3"


def test_iteration_1_is_compared_only_where_another_process_ran_just_before():
    def rec(config: str, rnd: int, first: float, finished: str) -> dict:
        return {"hidden": 4096, "release": "0.19.2", "tied": True, "config": config, "round": rnd, "rc": 0,
                "step_ms": 300.0, "step_ms_intervals": [first, 600.0, 300.0], "seconds": 30.0,
                "allocated_gib": 22.0, "max_allocated_gib": 27.0, "error": None, "finished": finished}
    records = [rec("fusion_off", 1, 7000.0, "2026-12-02T03:00:30Z"),  # first on a cold machine: left out
               rec("patched", 1, 1700.0, "2026-12-02T03:01:05Z"), rec("fusion_off", 2, 1800.0, "2026-12-02T03:01:40Z"),
               rec("patched", 2, 1750.0, "2026-12-02T05:00:00Z")]  # hours after the others: left out too

    def column(config: str) -> str:
        line = next(x for x in bench.summary(records).splitlines() if f"| {config} |" in x)
        return [c.strip() for c in line.split("|")][9]
    assert column("patched") == "1700.0 (-100.0)"
    assert column("fusion_off") == "1800.0 (+0.0)"
    records[0]["finished"] = "2026-12-02T02:00:00Z"
    records[1]["finished"] = "2026-12-02T03:00:00Z"  # now nothing ran right before it
    assert column("patched") == "-"


def test_the_llama_shapes_have_their_architecture_and_the_3b_recomputes(capsys):
    assert bench.main(["--dry", "--size", "llama3.2-3b", "--plan", "alternatives-untied", "--rounds", "1",
                       "--upstream", "/up"]) == 0
    out = capsys.readouterr().out.splitlines()
    commands = dict(zip(out[::2], out[1::2], strict=True))
    off = commands["# llama3.2-3b_0.19.2_untied_fusion_off_r1"]
    for flags in ("--num-layers 28 --hidden-size 3072 --num-attention-heads 24 --ffn-hidden-size 8192 "
                  "--seq-length 4096",
                  "--group-query-attention --num-query-groups 8", "--swiglu --normalization RMSNorm",
                  "--position-embedding-type rope --rotary-base 500000", "--disable-bias-linear",
                  "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                  "--untie-embeddings-and-output-weights", "--vocab-size 128256 "):
        assert flags in off, flags
    bf16 = commands["# llama3.2-3b_0.19.2_untied_bf16_grads_r1"]
    assert "GEMM_PATCH=0" not in bf16 and bf16.endswith("--megatron-fsdp-main-grads-dtype bf16")
    assert bench.main(["--dry", "--size", "llama3.2-1b", "--plan", "alternatives-0.17.1", "--rounds", "1"]) == 0
    one_b = capsys.readouterr().out
    assert "--hidden-size 2048 --num-attention-heads 32 --ffn-hidden-size 8192 --seq-length 8192" in one_b
    assert "--vocab-size 128255 " in one_b and "--recompute" not in one_b
    assert one_b.count("--log-interval 1 ") == 4 and "--log-memory-interval 20" in one_b  # every iteration's time
    assert bench.main(["--dry", "--size", "llama3.2-1b", "--plan", "0.19.2:tied:patched", "--rounds", "1",
                       "--log-interval", "5"]) == 0
    assert "--log-interval 5 " in capsys.readouterr().out  # as asked
    assert bench.main(["--dry", "--plan", "0.19.2:tied:patched", "--rounds", "1"]) == 0
    assert "--log-interval 5 " in capsys.readouterr().out  # hidden 4096 as its records were made


def test_a_record_of_another_log_interval_is_not_resumed_nor_compared(upstream, capsys):
    code, records = run_bench(upstream, "core")
    assert code == 0 and all(r["log_interval"] == bench.LOG_INTERVAL for r in records)
    out = upstream / "records.jsonl"
    older = [{k: v for k, v in r.items() if k != "log_interval"} for r in records]  # made before it was recorded
    out.write_text("".join(json.dumps(r) + "\n" for r in older))
    code, records = run_bench(upstream, "core", "--resume")
    assert code == 0 and len(records) == 2  # a record without it logged every LOG_INTERVAL: resumed
    code, records = run_bench(upstream, "core", "--resume", "--log-interval", "1")
    assert code == 0 and [r["log_interval"] for r in records[2:]] == [1, 1]
    table = bench.summary(records)
    assert table.count(" | patched | ") == 2 and "log every 1" in table  # two settings, never one median


def test_the_gpu_clock_is_read_beside_each_process(upstream, monkeypatch, capsys):
    smi = upstream / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    # name query: the card; sampling query: one idle line (start-up), then busy lines until stopped
    smi.write_text("#!/bin/sh\ncase \"$1\" in --query-gpu=name) echo 'NVIDIA H100 80GB HBM3';; *)\n"
                   f"echo \"$@\" > {upstream / 'smi_args'}\n"
                   "echo '2026/12/07 17:00:00.000, 0, 345, 1980, 70.1, 700.00, 35'\n"
                   "while true; do echo '2026/12/07 17:00:00.500, 100, 1755, 1980, 650.5, 700.00, 61';"
                   " echo '2026/12/07 17:00:01.000, 98, 1410, 1980, 699.0, 700.00, 66';"
                   " sleep 0.05; done;; esac\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    code, records = run_bench(upstream, "0.19.2:tied:patched")
    clocks = records[0]["gpu_clocks"]
    assert code == 0 and clocks["busy_samples"] == clocks["samples"] - 1 >= 2  # the idle line is left out
    assert clocks["sm_mhz_min"] == 1410 and clocks["sm_mhz_rated_max"] == 1980 and clocks["power_w_max"] == 699.0
    assert clocks["power_limit_w"] == 700.0 and clocks["temperature_c_max"] == 66
    assert [row[0] for row in clocks["by_iteration"]] == [5, 10]  # read against the process's log (lines 1, 5, 10)
    asked = (upstream / "smi_args").read_text()
    assert "--query-gpu=timestamp,utilization.gpu,clocks.sm," in asked and "-i 3 -lms 500" in asked
    assert "SM MHz=" in capsys.readouterr().out
    assert (upstream / "logs" / "hidden4096_0.19.2_tied_patched_r1.gpu.csv").read_text().count("\n") >= 3  # kept


def test_gpu_clock_readings_without_a_busy_or_valid_line():
    from benchmarks import gpu_clocks

    stamp = "2026/12/07 17:00:00.000, "
    assert gpu_clocks.summarise(stamp + "0, 345, 1980, 70.1, 700.00, 35\n") == {"samples": 1, "busy_samples": 0}
    said = gpu_clocks.summarise("Field \"clocks.max.sm\" is not a valid field to query.\n")
    assert said == {"error": 'nvidia-smi gave no reading: Field "clocks.max.sm" is not a valid field to query.'}
    assert gpu_clocks.summarise(stamp + "100, [N/A], 1980, 650.5, 700.00, 61\n")["error"].startswith("nvidia-smi")


def test_the_clock_beside_each_logged_iteration():
    from benchmarks import gpu_clocks

    log = "\n".join(f" [2026-12-07 17:00:0{s}.000000] iteration {it:8d}/      20 | elapsed time per iteration "
                    "(ms): 1.0 |" for s, it in ((1, 1), (3, 2), (5, 3)))
    samples = "\n".join(f"2026/12/07 17:00:0{s}.{ms}, 100, {mhz}, 1980, {w}, 700.00, 60" for s, ms, mhz, w in (
        (0, 500, 345, 70.0), (2, "000", 1980, 690.0), (2, 500, 1970, 700.0), (4, "000", 1410, 650.0)))
    # iteration 2 ran from 17:00:01 to :03 (two samples), iteration 3 from :03 to :05 (one); none before iteration 1
    assert gpu_clocks.by_iteration(log, samples) == [[2, 1975.0, 695.0, 100.0], [3, 1410.0, 650.0, 100.0]]
    assert gpu_clocks.by_iteration(log, "") == [[2, None, None, None], [3, None, None, None]]
    assert gpu_clocks.by_iteration("no iteration line", samples) == []


def test_how_busy_the_gpu_was_in_the_steps():
    """steps_utilization reads the samples between the first and last logged iteration only, and
    says a GPU that waits half of each step is half busy, where the clock's busy filter sees none of it."""
    from benchmarks import gpu_clocks

    log = "\n".join(f" [2026-12-07 17:00:0{s}.000000] iteration {it:8d}/      20 | elapsed time per iteration "
                    "(ms): 1.0 |" for s, it in ((1, 1), (5, 2)))
    def samples(busy: list[int]) -> str:  # start-up idle at :00.5, then 8 samples from :01.5, idle after at :06
        rows = [(0, 500, 0)] + [(1 + i // 2, 500 if i % 2 == 0 else 999, u) for i, u in enumerate(busy)] + [(6, 0, 0)]
        return "\n".join(f"2026/12/07 17:00:0{s}.{ms:03d}, {u}, 1980, 1980, 500.0, 700.00, 60" for s, ms, u in rows)

    waiting = gpu_clocks.steps_utilization(log, samples([100, 0] * 4))
    assert waiting == {"mean_percent": 50.0, "median_percent": 50.0, "samples": 8, "from_iteration": 1,
                       "to_iteration": 2}
    assert gpu_clocks.steps_utilization(log, samples([100] * 8))["mean_percent"] == 100.0
    assert gpu_clocks.steps_utilization(log, "") is None
    assert gpu_clocks.steps_utilization("no iteration line", samples([100] * 8)) is None
    said = gpu_clocks.reading(log, samples([30] * 8))  # never busy enough for the clock's filter
    assert said["busy_samples"] == 0 and said["steps_utilization"]["mean_percent"] == 30.0


def test_records_read_again_from_their_kept_logs(tmp_path, capsys):
    from benchmarks import gpu_clocks

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "a_r1.log").write_text(" [2026-12-07 17:00:01.000000] iteration        1/      20 |\n"
                                   " [2026-12-07 17:00:03.000000] iteration        2/      20 |\n")
    (logs / "a_r1.gpu.csv").write_text("2026/12/07 17:00:02.000, 40, 1980, 1980, 500.0, 700.00, 60\n")
    records = tmp_path / "r.jsonl"
    records.write_text(json.dumps({"log": "/tmp/L/a_r1.log", "gpu_clocks": None}) + "\n"
                       + json.dumps({"log": "/tmp/L/b_r1.log", "gpu_clocks": None}) + "\n")
    assert gpu_clocks.main(["--refresh", str(records), str(logs)]) == 0
    first, second = (json.loads(line) for line in records.read_text().splitlines())
    assert first["gpu_clocks"]["steps_utilization"]["mean_percent"] == 40.0 and second["gpu_clocks"] is None
    assert "1 record(s) read again" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gpu_clocks.main([str(logs / "a_r1.log")])


def test_no_nvidia_smi_no_gpu_clock(upstream, monkeypatch):
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    code, records = run_bench(upstream, "0.19.2:tied:patched")
    assert code == 0 and records[0]["gpu_clocks"] is None


def test_a_profiled_record_is_not_resumed_nor_compared_with_an_unprofiled_one(upstream):
    code, records = run_bench(upstream, "core")
    assert code == 0 and all(r["profile"] is None for r in records)
    out = upstream / "records.jsonl"
    profiled = [{**r, "profile": {"steps": 2, "gpu_busy_ms": 300.0, "gpu_idle_ms": 30.0}} for r in records]
    out.write_text("".join(json.dumps(r) + "\n" for r in profiled))
    code, records = run_bench(upstream, "core", "--resume")
    assert code == 0 and len(records) == 4 and [r["profile"] for r in records[2:]] == [None, None]
    table = bench.summary(records)
    assert table.count(" | patched | ") == 2 and ", profiled" in table  # the profiler's overhead in one row only
    code, records = run_bench(upstream, "core", "--resume")
    assert code == 0 and len(records) == 4  # both settings recorded: nothing runs again


def test_a_trace_cut_off_mid_write_is_said_in_the_record(tmp_path):
    """A process killed while the profiler writes its trace leaves a truncated .json.gz: the record
    says so, and the run goes on to the next process."""
    import gzip

    trace = tmp_path / "rank-0.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": []}).encode())[:-12])
    log = tmp_path / "run.log"
    log.write_text(LINE.format(it=1, ms=3000.0, tf=80.0) + "\n" + LINE.format(it=5, ms=700.0, tf=400.0) + "\n")
    rec = bench.record(("0.19.2", True, "patched"), 1, "hidden4096", 10, ["python3", "pretrain_gpt.py"], {}, 124,
                       115.0, log, trace=trace)
    assert rec["rc"] == 124 and rec["profile"]["error"].startswith(f"{trace}: Compressed file ended")


def test_patched_baseline_runs_the_other_trees_gemm_patch_and_only_where_named(upstream, capsys, monkeypatch):
    assert "patched_baseline" not in {c for _, _, c in bench.cells("0.19.2:tied:*")}
    with pytest.raises(SystemExit):
        run_bench(upstream, "0.19.2:tied:patched_baseline")
    said = capsys.readouterr().err
    assert "--baseline-tree (not given) must be a folder holding another version's gemm_patch" in said
    tree = upstream / "before"
    shutil.copytree(ROOT / "gemm_patch", tree / "gemm_patch", ignore=shutil.ignore_patterns("__pycache__"))
    both = "0.19.2:tied:patched,0.19.2:tied:patched_baseline"
    monkeypatch.chdir(upstream)  # a folder named from where the benchmark runs, not where the process runs
    code, records = run_bench(upstream, both, "--baseline-tree", "before")
    assert code == 0 and [(r["config"], r["baseline_tree"]) for r in records] == [("patched", None),
                                                                                 ("patched_baseline", "before")]
    ran = [json.loads(line) for line in (upstream / "argv.jsonl").read_text().splitlines()]
    assert [Path(r["startup"]).is_relative_to(tree) for r in ran] == [False, True] and all(r["patched"] for r in ran)
    code, records = run_bench(upstream, "0.19.2:tied:patched_baseline", "--resume", "--baseline-tree", "before")
    assert code == 0 and len(records) == 2  # the same tree: recorded already
    other = upstream / "other"
    shutil.copytree(tree, other)
    code, records = run_bench(upstream, "0.19.2:tied:patched_baseline", "--resume", "--baseline-tree", str(other))
    assert code == 0 and records[-1]["baseline_tree"] == str(other)  # another tree is another run


def test_a_record_of_another_collector_or_cpu_pinning_is_not_resumed(upstream):
    code, records = run_bench(upstream, "core")
    assert code == 0 and [r["manual_gc_interval"] for r in records] == [None, None]
    code, records = run_bench(upstream, "core", "--resume", "--manual-gc", "100")
    assert code == 0 and [r["manual_gc_interval"] for r in records] == [None, None, 100, 100]
    code, records = run_bench(upstream, "core", "--resume", "--cpus", "0")
    assert code == 0 and [r["cpus"] for r in records[4:]] == ["0", "0"]
    code, records = run_bench(upstream, "core", "--resume", "--manual-gc", "100")
    assert code == 0 and len(records) == 6  # each setting recorded once: nothing runs again


LINE = (" [2026-12-07 05:00:00.000000] iteration {it:8d}/      10 | consumed samples: 4 | elapsed time per iteration "
        "(ms): {ms:.1f} | throughput per GPU (TFLOP/s/GPU): {tf:.1f} | learning rate: 1.0E-04 | lm loss: 1.1E+01 |")


def test_megatron_throughput_after_the_first_line():
    text = "\n".join(LINE.format(it=it, ms=ms, tf=tf) for it, ms, tf in ((1, 3000.0, 80.0), (5, 700.0, 401.5),
                                                                          (10, 690.0, 410.5)))
    assert bench.throughput(text) == 406.0
    assert bench.throughput("no iteration line") is None


def rec(config: str, rnd: int, ms: float, alloc: float = 20.0, **extra) -> dict:
    size = bench.SIZES["llama3.2-1b"]
    return {"size": "llama3.2-1b", "hidden": 2048, "release": "0.19.2", "tied": True, "config": config,
            "round": rnd, "rc": 0, "step_ms": ms, "tokens_per_s": size["gbs"] * size["seq"] * 1000.0 / ms,
            "step_ms_intervals": [3000.0, 1200.0, ms, ms, ms], "iterations": 20,  # logged every 5: 1, 5, ..., 20
            "tflops": 400.0, "allocated_gib": alloc, "max_allocated_gib": alloc + 10,
            "device": "NVIDIA H100 80GB HBM3", "finished": "2026-12-07T05:00:00Z", "seconds": 30.0, **extra}


def test_shape_table_ratios_and_the_bound():
    records = [rec(c, r, ms) for r in (1, 2, 3) for c, ms in (("fusion_off", 700.0), ("patched", 690.0),
                                                              ("bf16_grads", 688.0), ("fixes_off", 689.0))]
    records.append(rec("patched", 1, 900.0, memory_history=True, memory_peak={"peak_gib": 30.0}))
    table = bench.shape_table(records)
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[2:]]
    rows = {c[2]: c for c in cells}
    assert list(rows) == ["fusion_off", "patched", "bf16_grads", "fixes_off"]
    assert len(cells) == 4  # a run slowed by the allocator's history is never timed against the others
    assert rows["fusion_off"][0] == "llama3.2-1b, 0.19.2, tied" and rows["fusion_off"][3] == "3"
    one = f"{4 * 8192 * 1000 / 700:,.0f}"
    assert rows["fusion_off"][4] == f"{one} ({one}-{one})" and rows["fusion_off"][5] == "400.0"
    assert rows["fusion_off"][8] == f"{700 / 690:.3f}" and rows["bf16_grads"][8] == f"{688 / 690:.3f}"
    bound = bench.fusion_saved_bytes(bench.SIZES["llama3.2-1b"]) / 3.35e12 * 1000
    assert rows["patched"][9] == f"10.0 / {bound:.1f} ({100 * 10 / 690:.1f}% / {100 * bound / 690:.1f}%)"
    assert "memory history" in bench.setting(records[-1])
    assert rows["patched"][10] == "-"  # no reading of the GPU's utilization
    busy = [rec("patched", r, 690.0, gpu_clocks={"steps_utilization": {"mean_percent": u}})
            for r, u in ((1, 48.0), (2, 60.0))]
    busy_cells = [c.strip() for c in bench.shape_table([*busy, rec("patched", 3, 690.0)]).splitlines()[2].split("|")]
    assert busy_cells[11] == "54 (2)"  # the median of the runs read, and how many
    spread = bench.shape_table([rec("patched", 1, 700.0), rec("patched", 2, 800.0), rec("patched", 3, 750.0),
                                rec("fusion_off", 1, 760.0)])
    tokens = [line.split("|")[5].strip() for line in spread.splitlines()[2:]]
    phased = bench.shape_table([rec("patched", 1, 700.0, step_ms_intervals=[3000.0, 1200.0, 700.0, 700.0, 1000.0])])
    cells = [c.strip() for c in phased.splitlines()[2].split("|")]
    assert cells[7] == "800.0" and cells[5] == f"{4 * 8192 * 1000 / 800:,.0f}"  # the run's time, not its median line
    assert tokens == [f"{4 * 8192 * 1000 / 760:,.0f}",  # one round: no range
                      f"{4 * 8192 * 1000 / 750:,.0f} ({4 * 8192 * 1000 / 800:,.0f}-{4 * 8192 * 1000 / 700:,.0f})"]


def test_the_steady_step_is_the_time_of_iterations_6_on_over_their_count():
    # logged every 5 (made before the iterations were recorded): lines at 1, 5, 10, 15, 20
    assert bench.steady_step_ms({"step_ms_intervals": [9000.0, 3000.0, 700.0, 800.0, 900.0], "iterations": 20}) == 800.0
    # every iteration, in phases: the median (fast phase) is not the run's rate; the mean is
    phases = [4000.0, 2700.0, 1400.0, 1400.0, 1400.0, *[1400.0] * 8, *[1900.0] * 7]
    every = {"step_ms_intervals": phases, "step_ms_iterations": list(range(1, 21)), "iterations": 20}
    assert bench.steady_step_ms(every) == round((8 * 1400.0 + 7 * 1900.0) / 15, 2)
    assert bench.steady_tokens_per_s({**every, "size": "llama3.2-3b"}) == pytest.approx(
        4 * 4096 * 1000.0 / ((8 * 1400.0 + 7 * 1900.0) / 15), rel=1e-5)
    # a run cut off before iteration 6, or lines that do not match its iteration count: no steady step
    assert bench.steady_step_ms({"step_ms_intervals": [9000.0, 3000.0], "iterations": 5}) is None
    assert bench.steady_step_ms({"step_ms_intervals": [9000.0, 3000.0, 700.0], "iterations": 20}) is None


def test_gemm_weights_of_a_llama_layer():
    """Llama 3.2 1B: 1.24 billion parameters, all but its 16 x 2 norms in a GEMM's weight (tied)."""
    size = bench.SIZES["llama3.2-1b"]
    assert bench.gemm_weight_params(size) == 16 * (2048 * (2048 + 2 * 512) + 2048 * 2048 + 2 * 2048 * 8192
                                                   + 8192 * 2048) + 128256 * 2048
    assert 1.23e9 < bench.gemm_weight_params(size) < 1.24e9


def test_the_collector_probe_runs_pretrain_gpt_and_is_kept_apart(upstream, capsys):
    code, (probed,) = run_bench(upstream, "0.19.2:tied:patched", "--gc-probe")
    assert code == 0
    assert "-m benchmarks.gc_probe pretrain_gpt.py" in probed["command"]
    assert probed["env"]["BENCH_GC_PROBE"].endswith("hidden4096_0.19.2_tied_patched_r1.gc.json")
    reading = probed["gc_probe"]
    assert reading["from_iteration"] == 1 and reading["to_iteration"] == 10  # read against the process's log
    assert "collector ms/step=" in capsys.readouterr().out and "gc probe" in bench.setting(probed)
    code, records = run_bench(upstream, "0.19.2:tied:patched", "--resume")
    assert code == 0 and len(records) == 2 and "gc_probe" not in records[1]  # a probed run is not this one
    lost = bench.collector_reading("", upstream / "absent.gc.json")
    assert "not written" in lost["error"] and "gc probe" in bench.setting({"gc_probe": lost})


def test_the_shape_table_says_how_long_the_collector_held_the_host():
    probed = [rec("patched", r, 690.0, gc_probe={"ms_per_step": ms, "longest_ms": longest})
              for r, ms, longest in ((1, 40.0, 120.0), (2, 60.0, 300.0))]
    unread = rec("patched", 3, 690.0, gc_probe={"error": "not written"})  # counted out, not as zero
    cells = [c.strip() for c in bench.shape_table([*probed, unread]).splitlines()[2].split("|")]
    assert cells[4] == "3" and cells[12] == "50.0; longest 300.0 (2)"
    plain = [c.strip() for c in bench.shape_table([rec("patched", 1, 690.0)]).splitlines()[2].split("|")]
    assert plain[12] == "-"


def test_a_profile_without_call_stacks_is_asked_for_and_kept_apart(upstream, capsys):
    assert bench.main(["--dry", "--plan", "0.19.2:tied:patched", "--rounds", "1", "--iters", "15", "--profile", "10:12",
                       "--no-profile-stacks"]) == 0
    bare = capsys.readouterr().out
    assert "--profile --use-pytorch-profiler --profile-step-start 10 --profile-step-end 12" in bare
    assert bench.main(["--dry", "--plan", "0.19.2:tied:patched", "--rounds", "1", "--iters", "15",
                       "--profile", "10:12"]) == 0
    stacks = capsys.readouterr().out
    assert "--use-pytorch-profiler --pytorch-profiler-collect-callstack --profile-step-start 10" in stacks
    with pytest.raises(SystemExit):
        bench.main(["--dry", "--plan", "core", "--no-profile-stacks"])
    assert "--no-profile-stacks: only with --profile START:END" in capsys.readouterr().err
    profiled = {"profile": {"steps": 2}, "profile_stacks": False}
    assert ", profiled without call stacks" in bench.setting(profiled)
    assert "without" not in bench.setting({**profiled, "profile_stacks": True})
    code, records = run_bench(upstream, "0.19.2:tied:patched")
    out = upstream / "records.jsonl"
    out.write_text(json.dumps({**records[0], **profiled}) + "\n")
    # with call stacks (the default) the record without them is not this run's
    code, records = run_bench(upstream, "0.19.2:tied:patched", "--resume", "--profile", "5:7")
    assert len(records) == 2 and records[1]["profile_stacks"] is True
