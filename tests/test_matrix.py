"""One test per release of compat/matrix.json (megatron-core and megatron-fsdp): compat/matrix.py
installs it on first use, runs its component's tests against it in its own interpreter and
probes every target's state, which must be the one the target's fingerprint table implies.

The releases run two at a time (GEMM_PATCH_MATRIX_JOBS); each prints one line to the terminal as
it finishes, captured output or not. The report goes to compat/.cache/matrix-report.md
(untracked); compat/COMPATIBILITY.md is written only by ``python compat/matrix.py --report``."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "compat"))
import matrix  # noqa: E402

# GEMM_PATCH_MATRIX_RELEASES="0.17.1 megatron-fsdp": some releases only (compat/matrix.py's selectors).
RELEASES = matrix.select(os.environ.get("GEMM_PATCH_MATRIX_RELEASES", "").split())


@pytest.fixture(scope="module")
def results(request):
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def say(line: str) -> None:
        if reporter is None:
            return
        # The terminal writer's stream is captured too while a fixture runs: lift capturing
        # for the line, so `pytest -q` shows it as it comes.
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            reporter.write_line(f"[matrix] {line}", flush=True)

    say(f"{len(RELEASES)} releases, {matrix.JOBS} at a time; one line each as it finishes")
    start = time.perf_counter()
    done = {}
    for result in matrix.run_matrix(RELEASES, note=say):
        done[result.release] = result
        say(result.line())
    wall = time.perf_counter() - start
    matrix.CACHE_REPORT.write_text(matrix.render_report([done[r] for r in RELEASES], wall))
    say(f"{sum(r.ok for r in done.values())}/{len(done)} releases ok in {wall:.0f}s; "
        f"report: {matrix.CACHE_REPORT.relative_to(matrix.ROOT)}")
    return done


@pytest.mark.parametrize("release", RELEASES, ids=[f"{r.component}-{r.version}" for r in RELEASES])
def test_release(results, release):
    result = results[release]
    assert result.failed == 0 and result.passed > 0, f"{release.label}: {result.failures}"
    assert result.states == result.expected, f"{release.label}: {result.states} != expected {result.expected}"
    assert (result.found_version or "").split("+")[0] == release.version, result.found_version
    assert result.ok


def test_every_registered_target_is_in_the_matrix():
    """A target whose distribution has no releases in the matrix would never be tested."""
    from gemm_patch.targets import REGISTRY

    components = {r.component for r in matrix.MATRIX}
    # NeMo cannot be imported without its dependency chain (lightning, ...): tests/test_nemo_target.py
    # runs NeMo's own init_ddp from each release's file (compat/nemo_sources.py fetches them).
    # TE cannot be imported without its CUDA library: tests/test_te_dummy_target.py runs TE's own
    # get_dummy_wgrad from each release's files (compat/te_sources.py fetches them).
    elsewhere = {"nemo-toolkit", "transformer-engine"}
    missing = {t.name: t.distribution for t in REGISTRY if t.distribution not in components | elsewhere}
    assert not missing, f"no releases of their distribution in compat/matrix.json: {missing}"
