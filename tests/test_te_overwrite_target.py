"""The fsdp-te-overwrite targets' gate and wrapper on synthetic modules shaped like
Megatron-FSDP's (no megatron needed; tests/megatron runs them against every release), the
summary-line rule, and the standalone megatron-fsdp package where it is importable."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types

import pytest
from source_modules import load_source

from gemm_patch.engine import config, patcher, report
from gemm_patch.engine.callsite import find_statement
from gemm_patch.engine.target import Refused, TargetStatus
from gemm_patch.support import module_state
from gemm_patch.targets import REGISTRY
from gemm_patch.targets.te_overwrite import STANDALONE as MFSDP_TE_OVERWRITE
from gemm_patch.targets.te_overwrite import TARGET as FSDP_TE_OVERWRITE
from gemm_patch.targets.te_overwrite import PatchedOverwriteFlag

torch = pytest.importorskip("torch")

METHOD = "all_gather_and_wait_parameters_ready"
STRICT = config.Config(strict=True)
LENIENT = config.Config()
ALLOW = config.Config(allow_unverified=True)
SOURCE = '''
class MegatronFSDP:
    def __init__(self, strategy):
        self.data_parallel_sharding_strategy = strategy
        self.calls = []

    def all_gather_and_wait_parameters_ready(self, params, prefetch=True, bwd=False):
        """Megatron-FSDP's shape: early return for no_shard, then two passes over params."""
        if self.data_parallel_sharding_strategy == "no_shard":
            return
        self.calls.append(list(params))
        for param in params:
            param.grad_added_to_main_grad = False
            param.__fsdp_param__ = True
            # TE: overwrite instead of accumulate
            param.overwrite_main_grad   =   True
'''


@pytest.fixture
def load(tmp_path):
    def load(source: str, name: str = "fake_megatron_fsdp"):
        return load_source(tmp_path, source, name)

    return load


def target_for(module, **changes):
    found = find_statement(module, "MegatronFSDP", METHOD, FSDP_TE_OVERWRITE.statement)
    return dataclasses.replace(FSDP_TE_OVERWRITE, fingerprints={"9.9.9": found.fingerprint}, **changes)


def param(distributed: bool | None):
    p = torch.nn.Parameter(torch.zeros(2, 2))
    if distributed is not None:
        p._gbuf = types.SimpleNamespace(is_data_distributed=distributed)
    return p


def test_verified_resets_persistent_only_and_undoes_exactly(load):
    module = load(SOURCE)
    cls = module.MegatronFSDP
    original = vars(cls)[METHOD]
    st, undo = target_for(module).patch(module, "9.9.9", STRICT)
    assert st.state == "verified" and st.fingerprint, st.reason
    installed = vars(cls)[METHOD]
    assert isinstance(installed, PatchedOverwriteFlag) and installed.__wrapped__ is original
    persistent, fresh, plain = param(False), param(True), param(None)
    obj = cls("optim_grads_params")
    obj.all_gather_and_wait_parameters_ready(iter([persistent, fresh, plain]))  # a one-shot iterator
    assert obj.calls == [[persistent, fresh, plain]]
    assert persistent.overwrite_main_grad is False
    assert fresh.overwrite_main_grad is True and plain.overwrite_main_grad is True
    assert persistent.__fsdp_param__ is True and installed.resets == 1
    undo.run()
    assert vars(cls)[METHOD] is original
    persistent.overwrite_main_grad = None
    obj.all_gather_and_wait_parameters_ready([persistent])
    assert persistent.overwrite_main_grad is True  # the upstream behaviour again


def test_the_wrapper_is_what_makes_the_difference(load):
    """The reset comes from the wrapper: with the wrapped function replaced by a recorder
    nothing but the reset happens, and with no wrapper the flag stays."""
    module = load(SOURCE)
    st, undo = target_for(module).patch(module, "9.9.9", STRICT)
    seen = []
    wrapper = PatchedOverwriteFlag(lambda self, params, **kw: seen.append(list(params)))
    p = param(False)
    p.overwrite_main_grad = True
    wrapper.__get__(module.MegatronFSDP("optim"))([p])
    assert seen == [[p]] and p.overwrite_main_grad is False
    undo.run()


def test_no_shard_adds_no_attribute(load):
    module = load(SOURCE)
    _, undo = target_for(module).patch(module, "9.9.9", STRICT)
    p = param(False)
    module.MegatronFSDP("no_shard").all_gather_and_wait_parameters_ready(params=[p])
    assert not hasattr(p, "overwrite_main_grad")
    undo.run()


@pytest.mark.parametrize("source, why", [
    (SOURCE.replace(f"def {METHOD}", "def other"), "has no MegatronFSDP.all_gather_and_wait_parameters_ready"),
    (SOURCE.replace("class MegatronFSDP", "class Other"), "has no MegatronFSDP."),
])
def test_not_applicable_without_the_method(load, source, why):
    module = load(source)
    before = {k: v for k, v in vars(module).items()}
    st, undo = FSDP_TE_OVERWRITE.patch(module, "9.9.9", STRICT)
    assert st.state == "not applicable" and why in st.reason, st.reason
    assert undo.steps == [] and all(vars(module)[k] is v for k, v in before.items())


@pytest.mark.parametrize("statement", [
    "pass",
    "flag = True; param.overwrite_main_grad = flag",  # a style-only edit that keeps the flag set
])
def test_without_the_statement_unknown_code_is_unverified(load, statement):
    """The method without the literal statement is not proof that nothing sets the flag: unknown
    code reads unverified (refused in strict mode); recorded code without it (the other form's,
    megatron-core 0.14.0's) reads not applicable."""
    module = load(SOURCE.replace("param.overwrite_main_grad   =   True", statement))
    before = {k: v for k, v in vars(module).items()}
    st, undo = FSDP_TE_OVERWRITE.patch(module, "9.9.9", config.Config())
    assert st.state == "unverified" and "no `param.overwrite_main_grad = True`" in st.reason, st.reason
    with pytest.raises(Refused):
        FSDP_TE_OVERWRITE.patch(module, "9.9.9", STRICT)
    assert undo.steps == [] and all(vars(module)[k] is v for k, v in before.items())
    recorded = dataclasses.replace(FSDP_TE_OVERWRITE, not_applicable={st.fingerprint: "recorded without it"})
    st, undo = recorded.patch(module, "9.9.9", STRICT)
    assert st.state == "not applicable" and "recorded without it" in st.reason and undo.steps == []


def test_the_other_forms_code_is_not_applicable():
    """Each form reads the other's recorded code as not applicable, and megatron-core 0.14.0's."""
    from gemm_patch.targets.te_overwrite import BY_STRATEGY_TARGET

    for fp in set(FSDP_TE_OVERWRITE.fingerprints.values()):
        assert "fsdp-te-overwrite patches" in BY_STRATEGY_TARGET.not_applicable[fp]
    for fp in set(BY_STRATEGY_TARGET.fingerprints.values()):
        assert "by-strategy patches" in FSDP_TE_OVERWRITE.not_applicable[fp]
    assert "0.14.0" in FSDP_TE_OVERWRITE.not_applicable["3bdddaa008f6fa19"]


def test_a_changed_method_is_left_alone_unless_allowed_and_refused_in_strict_mode(load):
    verified = load(SOURCE, "verified_fsdp")
    changed = load(SOURCE.replace("prefetch=True", "prefetch=False"))
    target = target_for(verified)
    original = vars(changed.MegatronFSDP)[METHOD]
    with pytest.raises(Refused, match="differs from the recorded"):
        target.patch(changed, "9.9.9", STRICT)
    st, undo = target.patch(changed, "9.9.9", LENIENT)
    assert st.state == "unverified" and "GEMM_PATCH_ALLOW_UNVERIFIED=1" in st.reason, st.reason
    assert undo.steps == [] and vars(changed.MegatronFSDP)[METHOD] is original
    st, undo = target.patch(changed, "9.9.9", ALLOW)
    assert st.state == "forced" and isinstance(vars(changed.MegatronFSDP)[METHOD], PatchedOverwriteFlag)
    undo.run()
    # Unknown release, known code: compatible, patched, the reason names the release it matches.
    st, undo = target.patch(verified, "1.0.0", STRICT)
    assert st.state == "compatible" and "identical to megatron-core 9.9.9" in st.reason, st.reason
    undo.run()


def test_switched_off_by_the_variable(load, monkeypatch):
    cfg = config.load({"GEMM_PATCH_TE_OVERWRITE": "0"}, switches=("GEMM_PATCH_TE_OVERWRITE",))
    module = load(SOURCE)
    original = vars(module.MegatronFSDP)[METHOD]
    st, undo = target_for(module).patch(module, "9.9.9", cfg)
    assert st.state == "off" and "GEMM_PATCH_TE_OVERWRITE=0" in st.reason
    assert undo.steps == [] and vars(module.MegatronFSDP)[METHOD] is original


def test_config_default_on_and_validated():
    var = (FSDP_TE_OVERWRITE.switch_variable,)
    assert var == (MFSDP_TE_OVERWRITE.switch_variable,) == ("GEMM_PATCH_TE_OVERWRITE",)
    assert config.load({}, switches=var).switch_on(var[0]) is True
    assert config.load({var[0]: "off"}, switches=var).switch_on(var[0]) is False
    with pytest.raises(config.ConfigError, match="GEMM_PATCH_TE_OVERWRITE='2'"):
        config.load({var[0]: "2"}, switches=var)


def test_targets_are_data():
    assert FSDP_TE_OVERWRITE in REGISTRY and MFSDP_TE_OVERWRITE in REGISTRY
    assert len({t.name for t in REGISTRY}) == len(REGISTRY)
    assert MFSDP_TE_OVERWRITE.module == "megatron_fsdp.megatron_fsdp"
    assert patcher._components["megatron_fsdp"] == MFSDP_TE_OVERWRITE.distribution == "megatron-fsdp"
    assert FSDP_TE_OVERWRITE.fingerprints["0.17.1"] == MFSDP_TE_OVERWRITE.fingerprints["0.6.1"]


def test_module_findable_without_importing(tmp_path, monkeypatch):
    pkg = tmp_path / "gp_fake_pkg" / "sub"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("raise AssertionError('imported')")
    (pkg / "mod.py").write_text("raise AssertionError('imported')")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_state.module_findable("gp_fake_pkg.sub.mod") is None  # top not imported: unknown
    import gp_fake_pkg  # noqa: F401

    try:
        assert module_state.module_findable("gp_fake_pkg.sub.mod") is True
        assert module_state.module_findable("gp_fake_pkg.sub.missing") is False
        assert module_state.module_findable("gp_fake_pkg.nope.mod") is False
        assert "gp_fake_pkg.sub" not in sys.modules
    finally:
        sys.modules.pop("gp_fake_pkg", None)


def test_each_module_with_a_patch_gets_its_own_info_line_whatever_came_first(monkeypatch):
    """The order megatron.training produces: Transformer Engine first (its target here not
    applicable or off), then megatron-core's layers, the MoE experts (nothing patched without
    TE's grouped MLP), then Megatron-FSDP. Every module with a patch is named at INFO; a module
    with nothing patched is DEBUG and takes no slot; a re-apply says nothing new."""
    from gemm_patch.targets import by_name

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    report.log.addHandler(handler)
    old_level = report.log.level
    report.log.setLevel(logging.DEBUG)
    monkeypatch.delenv("RANK", raising=False)
    summary = report.SummaryLog()

    def st(name, state="verified", reason=""):
        return by_name(name), TargetStatus(name, "megatron.core.x", state, reason, "0.17.1")

    try:
        summary.record("transformer-engine", "2.20.2", [st("te-dummy-wgrad", "off", "GEMM_PATCH_TE_DUMMY_WGRAD=0")],
                       "backends x")
        summary.record("megatron-core", "0.17.1", [st("fsdp-wgrad"), st("apex-wgrad")], "backends x")
        summary.record("megatron-core", "0.17.1", [st("fsdp-wgrad")], "backends x")  # re-apply: nothing new
        summary.record("megatron-core", "0.17.1", [st("moe-te-overwrite", "not applicable")], "backends x")
        summary.record("megatron-core", "0.17.1", [st("fsdp-te-overwrite"), st("fsdp-shared-grad"),
                                                   st("fsdp-one-rank-scale")], "backends x")
        summary.record("megatron-fsdp", "0.6.1", [st("mfsdp-te-overwrite")], "backends x")
        summary.record("nemo-toolkit", None, [st("nemo-fsdp-gaf", "off", "opt-in")], "backends x")
    finally:
        report.log.removeHandler(handler)
        report.log.setLevel(old_level)
    info = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert len(info) == 3, info
    assert info[0] == ("megatron-core 0.17.1: fsdp-wgrad verified, apex-wgrad provided (apex missing; verified); "
                       "backends x")
    assert info[1] == ("megatron-core 0.17.1: fsdp-te-overwrite verified, fsdp-shared-grad verified, "
                       "fsdp-one-rank-scale verified")
    assert info[2] == "megatron-fsdp 0.6.1: mfsdp-te-overwrite verified"
    debug = [r.getMessage() for r in records if r.levelno == logging.DEBUG]
    assert debug[0].startswith("transformer-engine 2.20.2: te-dummy-wgrad off")
    assert debug[-1] == "nemo-toolkit (version unknown): nemo-fsdp-gaf off (opt-in)"


def test_other_ranks_log_the_summary_at_debug(monkeypatch):
    from gemm_patch.targets import by_name

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    report.log.addHandler(handler)
    monkeypatch.setenv("RANK", "3")
    try:
        report.SummaryLog().record("megatron-core", "0.17.1", [
            (by_name("fsdp-wgrad"), TargetStatus("fsdp-wgrad", "m", "verified", "", "0.17.1"))], "backends x")
    finally:
        report.log.removeHandler(handler)
    assert [r.levelno for r in records] in ([], [logging.DEBUG])


def test_an_unknown_release_is_one_warning_line_for_all_targets(monkeypatch):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    report.log.addHandler(handler)
    monkeypatch.delenv("RANK", raising=False)
    why = "backward: backward unknown (fingerprint f differs); left alone (GEMM_PATCH_ALLOW_UNVERIFIED=1 patches it)"
    try:
        report.SummaryLog().record("megatron-core", "9.0.0", [
            (FSDP_TE_OVERWRITE, TargetStatus("fsdp-wgrad", "m", "unverified", why, "9.0.0")),
            (FSDP_TE_OVERWRITE, TargetStatus("apex-wgrad", "m", "unverified", why, "9.0.0"))], "backends x")
    finally:
        report.log.removeHandler(handler)
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "fsdp-wgrad unverified" in records[0].getMessage()
    assert "GEMM_PATCH_ALLOW_UNVERIFIED=1" in records[0].getMessage()


def test_a_package_that_is_not_installed_is_not_findable():

    assert module_state.module_findable("gemm_patch_no_such_package_xyz.megatron_fsdp") is False
