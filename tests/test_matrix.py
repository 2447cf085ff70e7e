"""One test per megatron-core release of compat/matrix.json: runs tests/megatron under that
release in its own interpreter (compat/run.py installs it on first use), and writes
compat/COMPATIBILITY.md when the whole matrix ran.

The releases run two at a time (CI has two cores and each child is mostly single-threaded);
each test then reports its own release."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "compat"))
import run as matrix  # noqa: E402

VERSIONS = [e["version"] for e in matrix.MATRIX]
WORKERS = int(os.environ.get("GEMM_PATCH_MATRIX_JOBS", "2"))


@pytest.fixture(scope="module")
def results():
    for version in VERSIONS:  # pip installs one at a time; the runs then overlap
        matrix.ensure_release(version)
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        done = dict(zip(VERSIONS, pool.map(matrix.run_release, VERSIONS), strict=True))
    matrix.write_report([done[v] for v in VERSIONS])
    return done


@pytest.mark.parametrize("version", VERSIONS)
def test_release(results, version):
    result = results[version]
    assert result.ok, f"megatron-core {version}: {result.failures}"
    assert result.state == result.expect
    assert result.apex_state == result.expect_apex
    assert result.te_overwrite_state == result.expect_te_overwrite
