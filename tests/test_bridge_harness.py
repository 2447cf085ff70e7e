"""examples/bridge/run_bridge.py's job commands on the CPU (no torch, no Bridge): every torchrun is
handed a .py training script, never an interpreter (the 2026-11-30 H200 call lost all four
pretraining runs to that), and the checker refuses the broken form."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BRIDGE = Path(__file__).resolve().parents[1] / "examples" / "bridge"
sys.path.insert(0, str(BRIDGE))
import run_bridge as rb  # noqa: E402


def args(*extra: str):
    class A:
        iters, test_path = 12, "tests/functional_tests/test_groups/megatron_fsdp"
    for k, v in zip(extra[::2], extra[1::2], strict=True):
        setattr(A, k, v)
    return A


def test_every_job_command_passes_the_check():
    jobs = rb.build_jobs(args(), {}, rb.WORK / "bt", set())
    assert [j.name for j in jobs] == ["unpatched", "patched", "off", "off_repeat", "tests_unpatched", "tests_patched"]
    assert rb.check_commands([*jobs, rb.timing_job(args(), {})]) == []
    for j in jobs:
        i = j.cmd.index("torch.distributed.run")
        assert sys.executable not in j.cmd[i:], j.cmd  # the interpreter only before torchrun


def test_the_2026_11_30_command_is_refused():
    bad = rb.Job("unpatched", [*rb.torchrun(29501), sys.executable, str(BRIDGE / "bridge_pretrain.py"),
                               "--out", "/tmp/x"], rb.ROOT, {}, 29501)
    (msg,) = rb.check_commands([bad])
    assert "not a .py file" in msg
    missing = rb.Job("x", [*rb.PATCH, *rb.torchrun(29502), "nope.py"], rb.ROOT, {}, 29502)
    assert "does not exist" in rb.check_commands([missing])[0]
    clash = [rb.Job(n, [*rb.torchrun(29503), str(BRIDGE / "bridge_pretrain.py")], rb.ROOT, {}, 29503) for n in "ab"]
    assert "also used by" in rb.check_commands(clash)[0]


def test_dry_run_prints_and_checks():
    r = subprocess.run([sys.executable, str(BRIDGE / "run_bridge.py"), "--dry-run", "--tests", "bt"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "command check: ok (7 jobs)" in r.stdout
