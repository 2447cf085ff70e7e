"""Which rank this process is (``detection.process_rank``): a launcher variable that cannot be
read as a rank makes it unknown, logged as a non-zero rank is, and never breaks the megatron
import that gemm_patch patches."""

from __future__ import annotations

import subprocess
import sys

import pytest
from process_env import clean_env

from gemm_patch.engine import detection

ALL = (*detection.RANK_VARIABLES, "LOCAL_RANK")


@pytest.fixture
def env(monkeypatch):
    for var in ALL:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("variables, rank", [
    ({}, 0),
    ({"RANK": "0"}, 0),
    ({"RANK": "3"}, 3),
    ({"RANK": " 3 "}, 3),
    ({"RANK": "03"}, 3),
    ({"RANK": ""}, 0),
    ({"RANK": "  ", "SLURM_PROCID": "2"}, 2),
    ({"RANK": "²"}, None),  # str.isdigit() says yes, int() says no
    ({"RANK": "٣"}, None),  # int() reads it as 3; no launcher writes it
    ({"RANK": "x"}, None),
    ({"RANK": "-1"}, None),
    ({"RANK": "+1"}, None),
    ({"RANK": "1.0"}, None),
    ({"RANK": "x", "SLURM_PROCID": "0"}, None),  # a broken RANK is not replaced by Slurm's task id
    ({"SLURM_PROCID": "5", "LOCAL_RANK": "0"}, 5),
    ({"OMPI_COMM_WORLD_RANK": "1"}, 1),
    ({"PMI_RANK": "0"}, 0),
    ({"LOCAL_RANK": "1"}, 1),
    ({"LOCAL_RANK": "0"}, 0),
    ({"LOCAL_RANK": "z"}, None),
])
def test_process_rank(env, variables, rank):
    for name, value in variables.items():
        env.setenv(name, value)
    assert detection.process_rank() == rank


def test_an_unreadable_rank_is_logged_once_at_debug(env, caplog):
    env.setenv("RANK", "²")
    detection._unparsable.clear()
    with caplog.at_level("DEBUG", logger="gemm_patch"):
        assert detection.process_rank() is None
        assert detection.process_rank() is None
    lines = [r for r in caplog.records if "is not a rank" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "DEBUG" and "RANK='²'" in lines[0].getMessage()


IMPORT = "import gemm_patch, megatron.core.tensor_parallel.layers; print('imported')"


# One real import per kind of value (test_process_rank reads every value in-process): an
# unparsable rank (also with DEBUG, below), a padded rank 0, LOCAL_RANK alone.
@pytest.mark.parametrize("variables, summary_at_info", [
    ({"RANK": "x"}, False),
    ({"RANK": " 0 "}, True),
    ({"LOCAL_RANK": "1"}, False),
])
def test_megatron_imports_whatever_the_rank_variables_hold(variables, summary_at_info):
    env = {k: v for k, v in clean_env(megatron=True).items() if k not in ALL}
    env.update(variables)
    proc = subprocess.run([sys.executable, "-c", IMPORT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "imported", proc.stderr
    info = [line for line in proc.stderr.splitlines() if line.startswith("[gemm_patch] INFO: megatron-core")]
    assert bool(info) == summary_at_info, proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_unreadable_rank_says_so_at_debug_in_a_real_import():
    env = {k: v for k, v in clean_env(megatron=True, GEMM_PATCH_LOG_LEVEL="DEBUG").items() if k not in ALL}
    env["RANK"] = "²"
    proc = subprocess.run([sys.executable, "-c", IMPORT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "[gemm_patch] DEBUG: RANK='²' is not a rank" in proc.stderr, proc.stderr
    assert "[gemm_patch] DEBUG: megatron-core" in proc.stderr, proc.stderr
