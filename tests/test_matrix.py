"""One test per megatron-core release of compat/matrix.json: runs tests/megatron under that
release in its own interpreter (compat/run.py installs it on first use), and writes
compat/COMPATIBILITY.md when the whole matrix ran."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "compat"))
import run as matrix  # noqa: E402

_results: dict[str, matrix.ReleaseResult] = {}


@pytest.mark.parametrize("version", [e["version"] for e in matrix.MATRIX])
def test_release(version):
    result = matrix.run_release(version)
    _results[version] = result
    assert result.ok, f"megatron-core {version}: {result.failures}"
    assert result.state == result.expect
    assert result.apex_state == result.expect_apex
    assert result.te_overwrite_state == result.expect_te_overwrite


def teardown_module(module):
    if len(_results) == len(matrix.MATRIX):
        matrix.write_report([_results[e["version"]] for e in matrix.MATRIX])
