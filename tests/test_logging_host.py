"""The host owns the ``gemm_patch`` logger: a level or handler it sets, before or after
``import gemm_patch``, named or not, is kept, and never breaks the megatron import that
gemm_patch patches. Real processes importing a real megatron-core release."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from process_env import clean_env

# argv: when the host sets the level ("before"/"after" import gemm_patch), the level.
HOST = """
import json, logging, sys
when, level = sys.argv[1], int(sys.argv[2])
if when == "before":
    logging.getLogger("gemm_patch").setLevel(level)
import gemm_patch
if when == "after":
    logging.getLogger("gemm_patch").setLevel(level)
import megatron.core.tensor_parallel.layers
print(json.dumps({"level": logging.getLogger("gemm_patch").level,
                  "patched": any(t.state == "verified" for t in gemm_patch.status().targets)}))
"""


def run(code: str, *args: str, **variables: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], env=clean_env(megatron=True, **variables),
                          capture_output=True, text=True, timeout=300)


def result(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Each unnamed level once, before and after the import both covered (a process each: the
# level must be in place when megatron's import logs the summary).
@pytest.mark.parametrize("when, level", [("before", logging.CRITICAL + 1), ("before", 15), ("after", 25)])
def test_a_host_level_is_kept_and_megatron_imports(when, level):
    proc = run(HOST, when, str(level))
    assert result(proc) == {"level": level, "patched": True}
    summary = [line for line in proc.stderr.splitlines() if line.startswith("[gemm_patch] INFO:")]
    assert bool(summary) == (level <= logging.INFO), proc.stderr  # 15 shows INFO, 25 and 51 do not
    assert "Traceback" not in proc.stderr


def test_an_explicit_gemm_patch_log_level_beats_a_level_set_before_import():
    proc = run(HOST, "before", str(logging.CRITICAL + 1), GEMM_PATCH_LOG_LEVEL="DEBUG")
    assert result(proc)["level"] == logging.DEBUG


def test_an_explicit_gemm_patch_log_level_yields_to_a_level_set_after_import():
    proc = run(HOST, "after", "25", GEMM_PATCH_LOG_LEVEL="DEBUG")
    assert result(proc)["level"] == 25


def test_no_host_setting_gives_info_and_the_prefixed_handler():
    proc = run(HOST, "none", "0")
    assert result(proc)["level"] == logging.INFO
    assert any(line.startswith("[gemm_patch] INFO: megatron-core") for line in proc.stderr.splitlines()), proc.stderr


def test_a_host_handler_is_kept_and_gemm_patch_adds_none():
    code = """
import json, logging, sys
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(logging.Formatter("HOST %(levelname)s %(message)s"))
logging.getLogger("gemm_patch").addHandler(handler)
import gemm_patch
import megatron.core.tensor_parallel.layers
log = logging.getLogger("gemm_patch")
print(json.dumps({"level": log.level, "handlers": len(log.handlers), "ours": log.handlers[0] is handler}))
"""
    proc = run(code)
    assert result(proc) == {"level": logging.INFO, "handlers": 1, "ours": True}
    assert any(line.startswith("HOST INFO megatron-core") for line in proc.stdout.splitlines()), proc.stdout
    assert "[gemm_patch]" not in proc.stderr, proc.stderr


def test_configure_logging_and_emit_never_derive_a_level_from_its_name():
    from gemm_patch.engine import report

    old_level, old_own = report.log.level, report._own_level
    try:
        report.log.setLevel(logging.CRITICAL + 1)
        report.emit(logging.DEBUG, "not shown")
        report.configure_logging()
        assert report.log.level == logging.CRITICAL + 1
        report.log.setLevel(15)
        report.emit(logging.DEBUG, "not shown")
        assert report.log.level == 15
    finally:
        report.log.setLevel(old_level)
        report._own_level = old_own
