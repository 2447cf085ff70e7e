"""benchmarks/profile_trace.py: its arithmetic on hand-made events in the profiler's Chrome format,
and its reading of a real torch.profiler trace (CPU, with Python frames) of steps that call
gemm_patch's dispatcher; and the benchmark runner's --profile against the fake pretrain_gpt.py."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from benchmarks import pretrain_gpt_bench as bench
from benchmarks import profile_trace

ROOT = Path(__file__).resolve().parents[2]


def event(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def test_busy_time_kinds_and_own_frames_per_step():
    own = "/site/gemm_patch/dispatcher.py(40): gemm"
    events = [
        event("user_annotation", "ProfilerStep#5", 0, 1000), event("user_annotation", "ProfilerStep#6", 1000, 1000),
        event("python_function", own, 100, 50), event("cpu_op", "aten::addmm", 110, 30),  # 20 us its own
        event("python_function", own, 1100, 40),
        event("python_function", "/site/gemm_patch/targets/fsdp_wgrad.py(9): twin", 1095, 50),  # outside own
        event("kernel", "nvjet_tst_128x256_h_bz_NNT", 200, 100, tid=7),
        event("kernel", "ncclDevKernel_ReduceScatter_Sum_f32", 250, 100, tid=8),  # overlaps: busy 150
        event("kernel", "vectorized_elementwise_kernel", 1200, 60, tid=7),
        event("gpu_memset", "Memset (Device)", 1300, 40, tid=7),
    ]
    r = profile_trace.analyse(events)
    assert r["steps"] == 2 and r["step_numbers"] == [5, 6] and r["host_step_ms"] == 1.0
    assert r["gpu_busy_ms"] == (150 + 60 + 40) / 2 / 1000 and r["kernel_ms"] == 0.13
    assert r["by_kind_ms"] == {"gemm": 0.05, "nccl": 0.05, "other": 0.03, "gpu_memset": 0.02}
    assert r["gemm_patch_self_ms"] == (20 + 10 + 40) / 2 / 1000  # the twin less the nested gemm frame
    assert r["gemm_patch_outermost_ms"] == (50 + 50) / 2 / 1000 and r["gemm_patch_calls_per_step"] == 1.0
    assert r["gemm_patch_self_ms_by_module"] == {"dispatcher.py": 0.03, "targets/fsdp_wgrad.py": 0.005}
    with pytest.raises(ValueError, match="no ProfilerStep"):
        profile_trace.analyse([e for e in events if e["cat"] != "user_annotation"])


def test_idle_time_and_what_the_host_did_meanwhile():
    events = [
        event("user_annotation", "ProfilerStep#3", 0, 1000),
        event("python_function", "hook.py(5): _grad_acc", 100, 300),       # 100-400
        event("cuda_runtime", "cudaStreamSynchronize", 150, 200),          # 150-350, inside the hook
        event("kernel", "elementwise", 120, 130, tid=7),                   # busy 120-250
        event("kernel", "gemm_nvjet", 600, 100, tid=7),                    # busy 600-700
    ]
    r = profile_trace.analyse(events)
    assert r["gpu_busy_ms"] == 0.23 and r["gpu_idle_ms"] == 0.77
    # The sync's idle part is 250-350; the hook's own is 100-120 and 350-400 (its child's taken out).
    assert r["idle_by_frame_ms"] == {"cudaStreamSynchronize": 0.1, "hook.py(5): _grad_acc": 0.07}
    assert r["syncs"] == {"cudaStreamSynchronize": {"ms": 0.2, "calls": 1.0}}
    assert "GPU idle in cudaStreamSynchronize | 0.1" in profile_trace.table({"a": r})


def test_a_real_cpu_trace_of_the_dispatcher(tmp_path):
    torch = pytest.importorskip("torch")
    from gemm_patch.gemm.dispatcher import WgradDispatcher

    dispatcher = WgradDispatcher("fallback")
    a, b = torch.randn(32, 16, dtype=torch.bfloat16), torch.randn(16, 24, dtype=torch.bfloat16)
    out = torch.zeros(32, 24)
    trace = tmp_path / "rank-0.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True,
                                schedule=torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1),
                                on_trace_ready=lambda p: p.export_chrome_trace(str(trace))) as prof:
        for _ in range(3):
            for _ in range(4):
                dispatcher.gemm(a, b, out, accumulate=True)
            prof.step()
    r = profile_trace.analyse(profile_trace.load(trace))
    assert r["steps"] == 2 and r["python_frames"] and r["kernel_ms"] == 0.0
    assert r["gemm_patch_calls_per_step"] == 4.0
    assert set(r["gemm_patch_self_ms_by_module"]) <= {"gemm/dispatcher.py", "gemm/backends.py"}
    assert 0 < r["gemm_patch_self_ms"] < r["gemm_patch_outermost_ms"] <= r["host_step_ms"]
    assert profile_trace.main([str(trace)]) == 0


def test_the_runner_profiles_and_keeps_the_reading_not_the_trace(tmp_path, monkeypatch):
    for release in bench.RELEASES:
        (tmp_path / "up" / release).mkdir(parents=True)
        shutil.copy(ROOT / "tests" / "probes" / "fake_pretrain.py", tmp_path / "up" / release / "pretrain_gpt.py")
    out = tmp_path / "records.jsonl"
    argv = ["--out", str(out), "--plan", "core", "--rounds", "1", "--iters", "10", "--python", sys.executable,
            "--launcher", "{python}", "--upstream", str(tmp_path / "up"), "--profile", "4:7"]
    assert bench.main(argv) == 0
    off, patched = bench.read_records(out)
    assert off["config"] == "fusion_off" and off["profile"]["steps"] == 3 and off["profile"]["kernel_ms"] == 0.12
    assert patched["profile"]["step_numbers"] == [4, 5, 6] and patched["profile"]["by_kind_ms"] == {"gemm": 0.1}
    assert "--profile-step-start 4 --profile-step-end 7 --tensorboard-dir " in patched["command"]
    assert not list(tmp_path.rglob("rank-0.json.gz"))
    with pytest.raises(SystemExit):
        bench.main([*argv[:-1], "7:4"])
    assert json.loads(out.read_text().splitlines()[0])["profile"] is not None
