"""GEMM_PATCH_APEX=replace: the named value config.py accepts beside 0/1 (``config.Named``), and
what the apex-wgrad target does with it on synthetic modules shaped like megatron-core's layers
module with a real apex imported (tests/megatron/test_apex_replace.py runs it on every release)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from source_modules import load_source
from test_apex_target import CALLS, CHECK, GUARD

from gemm_patch.engine import config, patcher
from gemm_patch.engine.config import Config, ConfigError, Named
from gemm_patch.engine.target import Refused
from gemm_patch.targets.apex_analysis import find_apex_usage
from gemm_patch.targets.apex_wgrad import STAND_IN, apex_word
from gemm_patch.targets.apex_wgrad import TARGET as APEX_WGRAD

EXT = APEX_WGRAD.extension
VAR = "GEMM_PATCH_APEX"
SPEC = {VAR: Named(default=True, values=("replace",))}


# -- config ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, on, chosen", [
    (None, True, None), ("", True, None), ("1", True, None), ("yes", True, None), ("0", False, None),
    ("off", False, None), ("replace", True, "replace"), (" Replace ", True, "replace"),
])
def test_named_switch_values(raw, on, chosen):
    env = {} if raw is None else {VAR: raw}
    cfg = config.load(env, switches=SPEC)
    assert cfg.switch_on(VAR) is on
    assert cfg.choice(VAR) == chosen
    assert cfg.choices == ({VAR: chosen} if chosen else {})


def test_a_bad_value_names_every_accepted_one():
    with pytest.raises(ConfigError) as err:
        config.load({VAR: "always"}, switches=SPEC)
    message = str(err.value)
    assert message.startswith("GEMM_PATCH_APEX='always' is not accepted; use one of 1, true, yes, on, 0, false")
    assert message.endswith(", replace (unset means 1)")


def test_a_plain_switch_still_refuses_a_named_value():
    with pytest.raises(ConfigError, match="use one of 1, true, yes, on, 0, false, no, off \\(unset"):
        config.load({"GEMM_PATCH_FSDP_WGRAD": "replace"}, switches={"GEMM_PATCH_FSDP_WGRAD": True})


def test_gemm_patch_0_reads_nothing_else():
    assert config.load({"GEMM_PATCH": "0", VAR: "nonsense"}, switches=SPEC).enabled is False


def test_the_target_declares_it_and_the_patcher_reads_it(monkeypatch):
    assert APEX_WGRAD.switch_values == SPEC[VAR].values and APEX_WGRAD.default_on == SPEC[VAR].default
    monkeypatch.setenv(VAR, "replace")
    assert patcher.load_config().choice(VAR) == "replace"
    monkeypatch.setenv(VAR, "1")
    cfg = patcher.load_config()
    assert cfg.choice(VAR) is None and cfg.switch_on(VAR) is True
    monkeypatch.setenv(VAR, "sometimes")
    with pytest.raises(ConfigError, match="replace"):
        patcher.load_config()


# -- the target -------------------------------------------------------------------------------

REPLACE = Config(switches={VAR: True}, choices={VAR: "replace"})


@pytest.fixture
def real(monkeypatch):
    """A real apex, simulated: importable under the extension's name."""
    fake = type(sys)(EXT)
    fake.wgrad_gemm_accum_fp32 = fake.wgrad_gemm_accum_fp16 = lambda *a: None
    monkeypatch.setitem(sys.modules, EXT, fake)
    return fake


@pytest.fixture
def load(tmp_path):
    return lambda source, name="fake_layers": load_source(tmp_path, source, name)


def target_for(module):
    fp = find_apex_usage(module, EXT, APEX_WGRAD.flag, APEX_WGRAD.calls).fingerprint
    return dataclasses.replace(APEX_WGRAD, fingerprints={"9.9.9": fp})


def test_replace_puts_the_stand_in_over_a_real_apex_and_undo_restores_it(load, real):
    module = load(GUARD + CHECK + CALLS)
    assert module.fused_weight_gradient_mlp_cuda is real and module._grad_accum_fusion_available is True
    before = dict(vars(module))
    target = target_for(module)
    st, undo = target.patch(module, "9.9.9", Config(**{**REPLACE.__dict__, "strict": True}))
    assert st.state == "verified", st.reason
    assert st.reason.startswith("apex real, replaced: fused_weight_gradient_mlp_cuda.{wgrad_gemm_accum_fp16, "
                                "wgrad_gemm_accum_fp32} routed through gemm_patch (GEMM_PATCH_APEX=replace)")
    assert module.fused_weight_gradient_mlp_cuda is STAND_IN and sys.modules[EXT] is STAND_IN
    assert apex_word(st) == "replaced"
    assert target.summary_part(st) == "apex-wgrad replaced apex (GEMM_PATCH_APEX=replace; verified)"
    assert target.in_place(module, undo) is None
    assert undo.run() == []
    assert sys.modules[EXT] is real
    assert vars(module).keys() == before.keys() and all(vars(module)[k] is before[k] for k in before)


def test_default_leaves_a_real_apex_untouched(load, real):
    module = load(GUARD + CHECK + CALLS)
    st, undo = target_for(module).patch(module, "9.9.9", Config(switches={VAR: True}))
    assert st.state == "apex real" and undo.steps == [] and sys.modules[EXT] is real
    assert "GEMM_PATCH_APEX=replace" in APEX_WGRAD.extra_states["apex real"]


def test_replace_where_apex_is_missing_provides_as_usual(load, monkeypatch):
    monkeypatch.delitem(sys.modules, EXT, raising=False)
    module = load(GUARD + CHECK + CALLS)
    st, undo = target_for(module).patch(module, "9.9.9", REPLACE)
    assert st.state == "verified" and st.reason.startswith("apex missing"), st.reason
    assert apex_word(st) == "provided" and module.fused_weight_gradient_mlp_cuda is STAND_IN
    undo.run()
    assert EXT not in sys.modules and module._grad_accum_fusion_available is False


def test_replace_also_covers_apex_imported_after_the_layers_module(load, monkeypatch):
    monkeypatch.delitem(sys.modules, EXT, raising=False)
    module = load(GUARD + CHECK + CALLS)
    late = type(sys)(EXT)
    monkeypatch.setitem(sys.modules, EXT, late)
    target = target_for(module)
    st, _ = target.patch(module, "9.9.9", Config(switches={VAR: True}))
    assert st.state == "skipped" and "GEMM_PATCH_APEX=replace replaces it" in st.reason
    st, undo = target.patch(module, "9.9.9", REPLACE)
    assert st.state == "verified" and st.reason.startswith("apex real, replaced"), st.reason
    assert sys.modules[EXT] is STAND_IN and module.fused_weight_gradient_mlp_cuda is STAND_IN
    undo.run()
    assert sys.modules[EXT] is late and "fused_weight_gradient_mlp_cuda" not in vars(module)
    assert module._grad_accum_fusion_available is False


def test_replace_keeps_the_gate(load, real):
    verified = load(GUARD + CHECK + CALLS, "verified_layers")
    changed = load(GUARD + CHECK + CALLS.replace("(total_input, grad_output,", "(grad_output, total_input,"))
    target = target_for(verified)
    st, undo = target.patch(changed, "9.9.9", REPLACE)
    assert st.state == "unverified" and undo.steps == [] and changed.fused_weight_gradient_mlp_cuda is real
    assert sys.modules[EXT] is real
    with pytest.raises(Refused):
        target.patch(changed, "9.9.9", Config(**{**REPLACE.__dict__, "strict": True}))


def test_replace_with_the_target_off_or_left_out_does_nothing(load, real):
    module = load(GUARD + CHECK + CALLS)
    cfg = Config(switches={VAR: True}, choices={VAR: "replace"}, left_out=frozenset({"apex-wgrad"}))
    st, undo = target_for(module).patch(module, "9.9.9", cfg)
    assert st.state == "off" and undo.steps == [] and sys.modules[EXT] is real
