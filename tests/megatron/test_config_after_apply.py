"""A configuration changed after the patch, then ``apply()``: what is installed becomes what the
configuration asks for, and status says what runs. A target turned off (``GEMM_PATCH_DISABLE``,
its own switch) is taken out, megatron's object back; ``GEMM_PATCH=0`` takes every patch out;
turned on again, ``apply()`` installs it again. Each part failed on 0.5.0, where ``apply()``
re-judged only targets that read ``off``."""

from __future__ import annotations

import pytest
import torch
from conftest import APPLICABLE, DTYPE_ERROR, layers, run_layer

import gemm_patch

pytestmark = [pytest.mark.proves("fsdp-wgrad"),
              pytest.mark.skipif(not APPLICABLE, reason="fsdp-wgrad not applicable on this release")]

OWNER = layers.LinearWithGradAccumulationAndAsyncCommunication


def backward():
    return vars(OWNER)["backward"]


def states() -> dict[str, tuple[str, str]]:
    return {t.name: (t.state, t.reason) for t in gemm_patch.status().targets}


@pytest.fixture
def original():
    gemm_patch.revert()
    megatrons = backward()
    gemm_patch.apply()
    assert backward() is not megatrons
    yield megatrons
    gemm_patch.apply()


@pytest.mark.parametrize("variable, value", [("GEMM_PATCH_DISABLE", "fsdp-wgrad"), ("GEMM_PATCH_FSDP_WGRAD", "0")])
def test_a_target_turned_off_after_the_patch_is_taken_out(original, monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    gemm_patch.apply()
    assert backward() is original, "megatron's own backward is back"
    state, reason = states()["fsdp-wgrad"]
    assert state == "off" and variable in reason
    with pytest.raises(RuntimeError, match=DTYPE_ERROR):  # megatron's own call runs, and crashes as shipped
        run_layer(torch.float32)
    monkeypatch.delenv(variable)
    gemm_patch.apply()
    assert backward() is not original and states()["fsdp-wgrad"][0] in ("verified", "compatible")
    result = run_layer(torch.float32)
    assert not torch.isnan(result["main_grad"]).any()


def test_gemm_patch_0_after_the_patch_takes_every_patch_out(original, monkeypatch):
    monkeypatch.setenv("GEMM_PATCH", "0")
    status = gemm_patch.apply()
    assert backward() is original
    assert not status.applied and status.disabled
    assert all(t.state == "off" for t in status.targets), [(t.name, t.state) for t in status.targets]
    monkeypatch.delenv("GEMM_PATCH")
    gemm_patch.apply()
    assert backward() is not original
