"""Which interpreter the version matrix gives each release (compat/matrix.py ``lane``): one venv
per Requires-Python floor, for the newest release of the component that declares it; the older
ones run here with --ignore-requires-python, and their lines say so. No release leaves the
matrix, and a quick run's whole-folder release may run in the other interpreter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "compat"))
import matrix  # noqa: E402

FLOORED = [r for r in matrix.MATRIX if r.python]
pytestmark = pytest.mark.skipif(not FLOORED or matrix._version_tuple(matrix.HERE.version)
                                >= matrix._version_tuple(FLOORED[0].python),
                                reason="every release's Requires-Python is met by this interpreter")


def newest(component: str) -> matrix.Release:
    return [r for r in FLOORED if r.component == component][-1]


def test_only_the_newest_release_of_a_floor_gets_its_venv(monkeypatch):
    monkeypatch.delenv("GEMM_PATCH_MATRIX_NATIVE", raising=False)
    lanes = {r: matrix.in_floor_lane(r) for r in matrix.MATRIX}
    assert [r for r, own in lanes.items() if own] == sorted({newest(r.component) for r in FLOORED},
                                                            key=matrix.MATRIX.index)
    older = [r for r in FLOORED if not lanes[r]]
    assert older, "the matrix lists older releases with a floor"
    for release in older:
        here = matrix.lane(release)
        assert here.python == matrix.HERE.python and here.fallback
        assert f"declares >={release.python}" in here.describe()
        assert "--ignore-requires-python" in here.describe()
        assert f"{newest(release.component).version} runs on {release.python}" in here.describe()
    assert all(matrix.lane(r) == matrix.HERE for r in matrix.MATRIX if not r.python)


def test_native_puts_every_floored_release_in_its_venv(monkeypatch):
    monkeypatch.setenv("GEMM_PATCH_MATRIX_NATIVE", "1")
    assert all(matrix.in_floor_lane(r) for r in FLOORED)


def test_a_release_the_matrix_does_not_list_gets_its_floor(monkeypatch):
    """compat/adopt.py's new release: it would be the newest."""
    monkeypatch.delenv("GEMM_PATCH_MATRIX_NATIVE", raising=False)
    new = matrix.Release(FLOORED[-1].component, "99.0.0", FLOORED[-1].prefix, FLOORED[-1].tests, FLOORED[-1].python)
    assert matrix.in_floor_lane(new)


def test_groups_span_interpreters(monkeypatch):
    """A quick release whose code equals a release in the floor's venv leaves its process tests
    to that one, in whichever interpreter: the plan never turns a quick run into a whole one
    for the interpreter alone."""
    monkeypatch.delenv("GEMM_PATCH_MATRIX_FULL", raising=False)
    scope = matrix.plan(matrix.MATRIX)
    for release, full_on in scope.items():
        if full_on is not None:
            assert matrix.fingerprint_key(full_on) == matrix.fingerprint_key(release)
    keys = {}
    for release in matrix.MATRIX:
        keys.setdefault((release.component, matrix.fingerprint_key(release)), []).append(release)
    assert all(sum(scope[r] is None for r in group) == 1 for group in keys.values())
