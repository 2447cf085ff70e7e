"""What a quick release of the version matrix runs (compat/matrix_quick.py, the matrix's pytest
plugin): every test that starts no process, and of a sweep the first layout of each check; the
counts of what it left to the whole-folder release, as compat/matrix.py reads them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

COMPAT = Path(__file__).resolve().parent.parent / "compat"
sys.path.insert(0, str(COMPAT))
import matrix_quick  # noqa: E402

TESTS = '''
import subprocess, sys
import pytest

LAYOUTS = pytest.mark.sweep("tied", "distributed")


@LAYOUTS
@pytest.mark.parametrize("change", ["revert", "reapply"])
@pytest.mark.parametrize("distributed", [False, True])
@pytest.mark.parametrize("tied", [True, False])
def test_sweep(tied, distributed, change):
    pass


@LAYOUTS
def test_sweep_without_parameters():
    pass


@pytest.mark.parametrize("tied", [True, False])
def test_no_sweep(tied):
    pass


@LAYOUTS
@pytest.mark.parametrize("tied", [True, False])
def test_a_process(tied):
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''


def run(tmp_path: Path, quick: bool) -> tuple[set[str], str]:
    (tmp_path / "test_layouts.py").write_text(textwrap.dedent(TESTS))
    env = {**os.environ, "PYTHONPATH": str(COMPAT), "GEMM_PATCH_MATRIX_QUICK": "1" if quick else "0",
           "GEMM_PATCH_MATRIX_PROCESS_ELSEWHERE": ""}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "matrix_quick",
                           str(tmp_path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = {line.split("::")[1].split(" ")[0] for line in proc.stdout.splitlines() if " PASSED" in line}
    return ran, proc.stdout


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "whole"])
def test_a_quick_release_runs_each_check_of_a_sweep_once_and_says_what_it_left(tmp_path, quick):
    ran, out = run(tmp_path, quick)
    every = {f"test_sweep[{t}-{d}-{c}]" for t in ("True", "False") for d in ("False", "True")
             for c in ("revert", "reapply")}
    plain = {"test_sweep_without_parameters", "test_no_sweep[True]", "test_no_sweep[False]"}
    if not quick:
        assert ran == every | plain | {"test_a_process[True]", "test_a_process[False]"}
        assert matrix_quick.left_elsewhere(out) == (0, 0)
        return
    # each change once, in the first layout; a test with no swept parameter, or none marked, whole
    assert ran == {"test_sweep[True-False-revert]", "test_sweep[True-False-reapply]"} | plain
    assert matrix_quick.left_elsewhere(out) == (2, 6)
