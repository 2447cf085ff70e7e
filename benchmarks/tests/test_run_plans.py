"""benchmarks/run_plans.sh: each name runs its plan, resumed from its records file; a dry run (the
runner's --dry through BENCH_ARGS) with a stand-in nvidia-smi shows what a GPU call would start."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "run_plans.sh"


def run(tmp_path: Path, *names: str, gpu: str = "NVIDIA H100 80GB HBM3", **env: str) -> subprocess.CompletedProcess:
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir(exist_ok=True)
    smi.write_text(f"#!/bin/sh\necho '{gpu}'\n")
    smi.chmod(0o755)
    environment = {**os.environ, "PATH": f"{smi.parent}{os.pathsep}{os.environ['PATH']}", "BENCH_ARGS": "--dry",
                   "NOTE": "gemm_patch_test", **env}
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), *names], env=environment, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)


@pytest.mark.skipif(shutil.which("md5sum") is None, reason="needs coreutils' md5sum")
def test_each_name_runs_its_plan_from_its_records(tmp_path):
    done = run(tmp_path, "shapes-3b-untied", "profile-3b", "gc-probe-3b")
    log = (tmp_path / "out" / "run_plans.log").read_text()
    assert done.returncode == 0, done.stderr + log
    assert "# llama3.2-3b_0.19.2_untied_bf16_grads_r3" in log  # the untied alternatives, 3 rounds
    assert "# llama3.2-3b_0.19.2_tied_patched_r1" in log and "--profile" in log
    assert "-m benchmarks.gc_probe pretrain_gpt.py" in log  # the collector's probe around the 3B's processes
    # a dry run changes no records file: none is left in OUT
    assert not list((tmp_path / "out").glob("*.jsonl"))


def test_refusals_say_what_is_wrong(tmp_path):
    unknown = run(tmp_path, "no-such-plan")
    assert unknown.returncode == 2 and "unknown plan name: no-such-plan" in unknown.stdout
    nothing = run(tmp_path)
    assert nothing.returncode == 2 and "te-branch-tests" in nothing.stderr
    other = run(tmp_path, "shapes-1b", gpu="NVIDIA A100")
    assert other.returncode == 2 and "no H100 or H200" in other.stderr
    baseline = run(tmp_path, "autograd-fixes")
    assert "BASELINE_TREE" in baseline.stderr + (tmp_path / "out" / "run_plans.log").read_text()
