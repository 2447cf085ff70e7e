"""Runs under one standalone megatron-fsdp release at a time (compat/matrix.py puts it on
PYTHONPATH and sets GEMM_PATCH_MATRIX_EXPECT to the state every target must read on it)."""

from __future__ import annotations

import gc
import json
import os

import pytest

torch = pytest.importorskip("torch")
module = pytest.importorskip("megatron_fsdp.megatron_fsdp")


def _expected_states() -> dict[str, str]:
    """{target: state}: from compat/matrix.py, or, run by hand, by the same rule (each target's
    fingerprint table) for the megatron-fsdp on sys.path."""
    if os.environ.get("GEMM_PATCH_MATRIX_EXPECT"):
        return json.loads(os.environ["GEMM_PATCH_MATRIX_EXPECT"])
    from gemm_patch.engine import detection
    from gemm_patch.targets import REGISTRY

    version = detection.distribution_version("megatron-fsdp")
    return {t.name: t.expected_state(version) for t in REGISTRY if t.distribution == "megatron-fsdp"}


EXPECTED = _expected_states()


def expected(target: str) -> str:
    return EXPECTED[target]


@pytest.fixture(scope="session", autouse=True)
def frozen_imports():
    """As tests/megatron/conftest.py's: the imports' objects out of the collector's way."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
