"""The summary lines a Megatron-FSDP job prints, with the import order ``megatron.training``
really produces: gemm_patch first (``gemm-patch run`` / the .pth), then what training.py and
arguments.py import before any model is built (Transformer Engine where it is installed, not on
this CPU machine; ``megatron.core.tensor_parallel``; ``megatron.core.distributed``, which
imports Megatron-FSDP; the MoE experts). Rank 0 (or no RANK) gets one INFO line naming the
layers fix and one naming the Megatron-FSDP fixes; another rank gets nothing at INFO."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import expected

TRAINING_IMPORTS = """
import gemm_patch
import megatron.core.tensor_parallel
import megatron.core.distributed
import megatron.core.transformer.moe.experts
"""
FSDP_TARGETS = ("fsdp-te-overwrite", "fsdp-te-overwrite-by-strategy", "fsdp-shared-grad", "fsdp-one-rank-scale")
PATCHED = ("verified", "compatible", "forced")


def run(rank: str | None) -> subprocess.CompletedProcess:
    # The gate stays as the run sets it (adoption opens it for the code under test).
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith("GEMM_PATCH") or k == "GEMM_PATCH_ALLOW_UNVERIFIED") and k != "RANK"}
    if rank is not None:
        env["RANK"] = rank
    return subprocess.run([sys.executable, "-c", TRAINING_IMPORTS], capture_output=True, text=True,
                          env=env, timeout=300)


def info_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[gemm_patch] INFO:")]


@pytest.mark.parametrize("rank", [pytest.param(None, id="no RANK", marks=pytest.mark.common_machinery),
                                  pytest.param("0", id="RANK=0")])
def test_rank_0_names_each_fix_once_at_info(rank):
    out = run(rank)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = info_lines(out.stderr)
    wgrad = next((n for n in ("fsdp-wgrad", "fsdp-wgrad-gemm") if expected(n) in PATCHED), None)
    if wgrad:
        assert len([line for line in lines if f"{wgrad} {expected(wgrad)}" in line]) == 1, out.stderr
    patched = [f"{name} {expected(name)}" for name in FSDP_TARGETS if expected(name) in PATCHED]
    if patched:
        fsdp = [line for line in lines if any(words in line for words in patched)]
        assert len(fsdp) == 1, out.stderr
        assert all(words in fsdp[0] for words in patched), fsdp[0]
    assert len(lines) == len(set(lines)), out.stderr
    assert not [line for line in out.stderr.splitlines() if "WARNING" in line or "ERROR" in line], out.stderr


@pytest.mark.common_machinery
def test_other_ranks_say_nothing_at_info():
    out = run("1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert not [line for line in out.stderr.splitlines() if line.startswith("[gemm_patch]")], out.stderr
