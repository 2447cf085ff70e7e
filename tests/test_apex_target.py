"""The apex-wgrad target's gate on synthetic modules shaped like megatron-core's layers module:
not applicable where the module has no apex usage at all, unverified where the guarded import or
the calls are not found in unknown code and for an unknown release, exact undo (no megatron
needed; tests/megatron runs it against every release)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from source_modules import load_source

from gemm_patch.engine.config import Config
from gemm_patch.engine.target import Refused
from gemm_patch.targets.apex_analysis import find_apex_usage
from gemm_patch.targets.apex_wgrad import STAND_IN, apex_word
from gemm_patch.targets.apex_wgrad import TARGET as APEX_WGRAD

STRICT = Config(strict=True)

EXT = APEX_WGRAD.extension

GUARD = """
_grad_accum_fusion_available = True
try:
    import fused_weight_gradient_mlp_cuda
except ImportError:
    _grad_accum_fusion_available = False
"""
CHECK = """
def build(config):
    if config.gradient_accumulation_fusion and not _grad_accum_fusion_available:
        raise RuntimeError("no apex")
"""
CALLS = """
def backward(total_input, grad_output, weight):
    if weight.main_grad.dtype == "fp32":
        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
    else:
        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, weight.main_grad)
"""


@pytest.fixture
def load(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, EXT, raising=False)

    def load(source: str, name: str = "fake_layers"):
        return load_source(tmp_path, source, name)

    return load


def target_for(module, **changes):
    fp = find_apex_usage(module, EXT, APEX_WGRAD.flag, APEX_WGRAD.calls).fingerprint
    return dataclasses.replace(APEX_WGRAD, fingerprints={"9.9.9": fp}, **changes)


def test_provides_and_undoes_exactly(load):
    module = load(GUARD + CHECK + CALLS)
    before = dict(vars(module))
    st, undo = target_for(module).patch(module, "9.9.9", STRICT)
    assert st.state == "verified", st.reason
    assert module.fused_weight_gradient_mlp_cuda is STAND_IN and sys.modules[EXT] is STAND_IN
    assert module._grad_accum_fusion_available is True
    assert apex_word(st) == "provided"
    undo.run()
    assert EXT not in sys.modules
    assert vars(module).keys() == before.keys() and all(vars(module)[k] is before[k] for k in before)


ALIASED_CALLS = CALLS.replace("    if weight", "    apex = fused_weight_gradient_mlp_cuda\n    if weight").replace(
    "        fused_weight_gradient_mlp_cuda.wgrad", "        apex.wgrad")


@pytest.mark.parametrize("source, why", [
    (CHECK + CALLS, "no guarded `import fused_weight_gradient_mlp_cuda`"),
    (GUARD + CHECK, "calls none of"),
    (GUARD + CHECK + ALIASED_CALLS, "calls none of"),  # a style-only edit: the calls through a local name
])
def test_without_the_guard_or_the_calls_unknown_code_is_unverified(load, source, why):
    """Code that uses apex in a way the source match does not see may still need the stand-in:
    unknown code, left alone with the reason, never "not applicable" on a guess."""
    module = load(source)
    st, undo = APEX_WGRAD.patch(module, "9.9.9", Config())
    assert st.state == "unverified" and why in st.reason and "another form" in st.reason, st.reason
    assert undo.steps == [] and EXT not in sys.modules
    with pytest.raises(Refused, match="GEMM_PATCH_STRICT"):
        APEX_WGRAD.patch(module, "9.9.9", STRICT)
    st, undo = APEX_WGRAD.patch(module, "9.9.9", Config(allow_unverified=True))
    assert st.state == "not applicable" and "GEMM_PATCH_ALLOW_UNVERIFIED=1" in st.reason and undo.steps == []
    recorded = dataclasses.replace(APEX_WGRAD, not_applicable={st.fingerprint: "a layers module without apex"})
    st, undo = recorded.patch(module, "9.9.9", STRICT)
    assert st.state == "not applicable" and "a layers module without apex" in st.reason, st.reason
    assert undo.steps == [] and EXT not in sys.modules
    assert apex_word(st) == "missing"


def test_a_module_without_apex_usage_is_not_applicable(load):
    module = load("def backward(total_input, grad_output, weight):\n    return total_input\n")
    st, undo = APEX_WGRAD.patch(module, "9.9.9", STRICT)
    assert st.state == "not applicable" and "no guarded" in st.reason, st.reason
    assert undo.steps == [] and EXT not in sys.modules


def test_a_changed_call_is_unverified_and_refused_in_strict_mode(load):
    verified = load(GUARD + CHECK + CALLS, "verified_layers")
    changed = load(GUARD + CHECK + CALLS.replace("(total_input, grad_output,", "(grad_output, total_input,"))
    target = target_for(verified)
    with pytest.raises(Refused, match="differs from the recorded"):
        target.patch(changed, "9.9.9", STRICT)
    assert EXT not in sys.modules
    st, undo = target.patch(changed, "9.9.9", Config())
    assert st.state == "unverified" and EXT not in sys.modules and undo.steps == []
    st, undo = target.patch(changed, "9.9.9", Config(allow_unverified=True))
    assert st.state == "forced" and sys.modules[EXT] is STAND_IN
    undo.run()


def test_a_real_extension_is_never_shadowed(load, monkeypatch):
    real = type(sys)(EXT)
    monkeypatch.setitem(sys.modules, EXT, real)
    module = load(GUARD + CHECK + CALLS)
    assert module.fused_weight_gradient_mlp_cuda is real
    st, undo = target_for(module).patch(module, "9.9.9", STRICT)
    assert st.state == "apex real" and undo.steps == []
    assert sys.modules[EXT] is real and module._grad_accum_fusion_available is True
    assert apex_word(st) == "real"


def test_switched_off_by_the_variable(load, monkeypatch):
    cfg = Config(switches={"GEMM_PATCH_APEX": False})
    module = load(GUARD + CHECK + CALLS)
    st, undo = target_for(module).patch(module, "9.9.9", cfg)
    assert st.state == "off" and "GEMM_PATCH_APEX=0" in st.reason
    assert undo.steps == [] and EXT not in sys.modules and module._grad_accum_fusion_available is False
    assert apex_word(st) == "off"
