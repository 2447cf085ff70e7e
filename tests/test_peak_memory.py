"""The peak memory .ci/run says for each pytest process: compat/peak_memory.py, a pytest plugin,
records it where PYTEST_PEAK_MEMORY_LOG is set, then says it and fails over its limit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "compat"))
import peak_memory  # noqa: E402


def test_a_pytest_process_records_its_peak(tmp_path):
    log = tmp_path / "peak.tsv"
    env = {**os.environ, "PYTEST_PEAK_MEMORY_LOG": str(log)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "compat.peak_memory",
                    "--collect-only", "tests/test_config.py"], cwd=ROOT, env=env, capture_output=True, check=True)
    [process] = peak_memory.read(log)
    assert process.pid != os.getpid() and process.parent == os.getpid()
    assert 10 << 10 < process.peak_kib < peak_memory.GIB, process  # a Python process's, in KiB
    assert process.command().endswith("tests/test_config.py")


def test_each_process_is_said_and_one_over_the_limit_fails():
    unit = peak_memory.Process(10, 1, 3 << 20, 1 << 20, "-q --ignore=tests/test_matrix.py")
    matrix = peak_memory.Process(11, 1, 1 << 19, 1 << 20, "-q tests/test_matrix.py")
    releases = [peak_memory.Process(20 + n, 11, (n + 1) << 18, 0, f"tests/megatron --junitxml={n}.xml")
                for n in range(3)]
    lines, ok = peak_memory.summary([unit, matrix, *releases], limit_gib=4)
    assert ok, lines
    assert any("3.00 GiB  pytest -q --ignore=tests/test_matrix.py" in line for line in lines), lines
    assert any("0.75 GiB  the largest of the 3 pytest runs it started: pytest tests/megatron --junitxml=2.xml"
               in line for line in lines), lines
    lines, ok = peak_memory.summary([unit, matrix, *releases], limit_gib=2)
    assert not ok and lines[-1] == "  over 2 GiB: 3.00 GiB pytest -q --ignore=tests/test_matrix.py", lines
    assert peak_memory.summary([], limit_gib=4)[1] is False  # nothing recorded is no evidence
    lines, ok = peak_memory.summary([matrix, *releases], limit_gib=4, expect=2)  # the unit tests killed
    assert not ok and "1 pytest process(es) recorded nothing" in lines[-1], lines
