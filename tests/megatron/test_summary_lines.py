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
FSDP_TARGETS = ("fsdp-te-overwrite", "fsdp-shared-grad", "fsdp-one-rank-scale")


def run(rank: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH") and k != "RANK"}
    if rank is not None:
        env["RANK"] = rank
    return subprocess.run([sys.executable, "-c", TRAINING_IMPORTS], capture_output=True, text=True,
                          env=env, timeout=300)


def info_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[gemm_patch] INFO:")]


@pytest.mark.parametrize("rank", [None, "0"], ids=["no RANK", "RANK=0"])
def test_rank_0_names_each_fix_once_at_info(rank):
    out = run(rank)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = info_lines(out.stderr)
    if expected("fsdp-wgrad") == "verified":
        assert len([line for line in lines if "fsdp-wgrad verified" in line]) == 1, out.stderr
    verified = [name for name in FSDP_TARGETS if expected(name) == "verified"]
    if verified:
        fsdp = [line for line in lines if any(f"{name} verified" in line for name in verified)]
        assert len(fsdp) == 1, out.stderr
        assert all(f"{name} verified" in fsdp[0] for name in verified), fsdp[0]
    assert len(lines) == len(set(lines)), out.stderr
    assert not [line for line in out.stderr.splitlines() if "WARNING" in line or "ERROR" in line], out.stderr


def test_other_ranks_say_nothing_at_info():
    out = run("1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert not [line for line in out.stderr.splitlines() if line.startswith("[gemm_patch]")], out.stderr
