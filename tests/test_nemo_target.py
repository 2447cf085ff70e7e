"""nemo-fsdp-gaf against NeMo's own ``nemo/lightning/megatron_parallel.py`` of every release it
records (installed with ``pip install --no-deps --target compat/.cache/nemo-X nemo-toolkit==X``;
a release not installed there is skipped).

Why not ``import nemo.lightning.megatron_parallel``: without its dependencies it stops at
``nemo/lightning/__init__.py`` (``from lightning.fabric.plugins.environments import slurm``:
no module named 'lightning'; ``nemo.utils`` needs dateutil, ...), and installing NeMo's
dependency tree is out of scale for a CPU test. So each test builds the module from the
release's file: a module object whose ``__file__`` is that file, whose ``MegatronParallel.init_ddp``
is the function the import would define (compiled from the file's text, as the import does, so
``check_live_is_source`` sees the real thing), and whose other globals (the FSDP class, DDP,
``getattr_proxy``, ...) and the modules ``init_ddp`` imports inside (``nemo.utils``,
``megatron.core``) are small stand-ins. ``init_ddp`` then runs NeMo's real code, end to end.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
from contextlib import nullcontext
from pathlib import Path

import pytest

from gemm_patch.engine import config
from gemm_patch.engine.callsite import fingerprint, parse_method
from gemm_patch.engine.target import PatchedTwin
from gemm_patch.targets import nemo_fsdp_gaf
from gemm_patch.targets.nemo_fsdp_gaf import TARGET, fused_path_ready

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "compat" / ".cache"
RELEASES = sorted(TARGET.fingerprints, key=lambda v: tuple(int(x) for x in v.split(".")))
MEGATRON_FSDP = [v for v in RELEASES if v != "2.5.0"]  # 2.5.0's branch is custom_fsdp only
MODULE = "nemo.lightning.megatron_parallel"
ON = config.Config(switches={TARGET.switch_variable: True})
READY = {"fsdp-wgrad": "verified", "apex-wgrad": "verified", "fsdp-te-overwrite": "verified"}
WARNING = "Setting module.config.gradient_accumulation_fusion to False for MCore FSDP."


def source_file(version: str) -> Path:
    path = CACHE / f"nemo-{version}" / "nemo" / "lightning" / "megatron_parallel.py"
    if not path.exists():
        pytest.skip(f"nemo-toolkit {version} not installed: pip install --no-deps --target "
                    f"compat/.cache/nemo-{version} nemo-toolkit=={version}")
    return path


class FakeFSDP:
    """Stands in for megatron-core's FullyShardedDataParallel: records what it was built with."""

    built_with: list[bool] = []

    def __init__(self, config, ddp_config, module, disable_bucketing=False):
        FakeFSDP.built_with.append(config.gradient_accumulation_fusion)
        self.module = module
        self.param_and_grad_buffer = object()


def nemo_module(path: Path, name: str = MODULE) -> types.ModuleType:
    """The release's module as the import would define ``MegatronParallel.init_ddp`` (see the
    module docstring), with stand-ins for the rest."""
    module = types.ModuleType(name)
    module.__file__ = str(path)
    code = compile(path.read_text(), str(path), "exec", dont_inherit=True)
    body = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == "MegatronParallel")
    init_ddp = next(c for c in body.co_consts if isinstance(c, types.CodeType) and c.co_name == "init_ddp")
    module.MegatronParallel = type("MegatronParallel", (list,), {
        "init_ddp": types.FunctionType(init_ddp, module.__dict__, "init_ddp"), "__module__": name})

    class DistributedDataParallelConfig:
        use_megatron_fsdp = True
        use_custom_fsdp = True

    vars(module).update(
        DistributedDataParallelConfig=DistributedDataParallelConfig, OptimizerConfig=type("OptimizerConfig", (), {}),
        HAVE_MEGATRON_FSDP=True, HAVE_CUSTOM_FSDP=False, FullyShardedDataParallel=FakeFSDP,
        DDP=type("DDP", (), {}), nullcontext=nullcontext, torch=types.SimpleNamespace(enable_grad=nullcontext),
        types=types, getattr_proxy=lambda self, item: None, extract_ddp_funcs=lambda ddp_config, pipeline: (None, None),
    )
    return module


def install_stand_ins(setitem) -> list[str]:
    """``from nemo.utils import logging``, ``from nemo.utils.model_utils import unwrap_model``,
    ``from megatron.core import parallel_state``, ``from megatron.core.transformer.module import
    Float16Module`` inside init_ddp, each module put in place with ``setitem(sys.modules, ...)``;
    returns the list NeMo's warnings go to."""
    warnings: list[str] = []
    stand_ins = {
        "nemo": {}, "nemo.utils": {"logging": types.SimpleNamespace(warning=warnings.append)},
        "nemo.utils.model_utils": {"unwrap_model": lambda module, *classes: module},
        "megatron": {}, "megatron.core": {"parallel_state": types.SimpleNamespace()},
        "megatron.core.transformer": {},
        "megatron.core.transformer.module": {"Float16Module": type("Float16Module", (), {})},
    }
    for name, attributes in stand_ins.items():
        module = types.ModuleType(name)
        vars(module).update(attributes)
        setitem(sys.modules, name, module)
    FakeFSDP.built_with = []
    return warnings


@pytest.fixture
def nemo_imports(monkeypatch):
    return install_stand_ins(monkeypatch.setitem)


def run_init_ddp(module: types.ModuleType, fusion: bool | None) -> types.SimpleNamespace:
    """NeMo's init_ddp over one model chunk whose config asks for ``fusion`` (None: no such
    attribute); returns the config afterwards."""
    cfg = types.SimpleNamespace(use_megatron_fsdp=True, use_custom_fsdp=True)
    if fusion is not None:
        cfg.gradient_accumulation_fusion = fusion

    class Chunk:  # NeMo reads __getattr__'s code and installs getattr_proxy on the class
        def __getattr__(self, item):
            raise AttributeError(item)

    chunk = Chunk()
    chunk.config = cfg
    chunk.module = types.SimpleNamespace(config=cfg, parameters=lambda: iter(()))
    parallel = module.MegatronParallel([chunk])
    parallel.ddp_config = module.DistributedDataParallelConfig()
    parallel.fsdp = "megatron"
    parallel.init_ddp()
    assert isinstance(chunk.module, FakeFSDP)  # NeMo's Megatron-FSDP branch ran
    return cfg


def patched(version: str, monkeypatch, states: dict[str, str] = READY, cfg: config.Config = ON):
    module = nemo_module(source_file(version))
    monkeypatch.setattr(nemo_fsdp_gaf, "_live_states", lambda: dict(states))
    st, undo = TARGET.patch(module, version, cfg)
    return module, st, undo


# -- every recorded release: the fingerprint and the one `if` ------------------------------------


@pytest.mark.parametrize("version", RELEASES)
def test_every_release_is_verified_with_its_recorded_fingerprint(version, monkeypatch):
    path = source_file(version)
    module = nemo_module(path)
    assert fingerprint(parse_method(module, "MegatronParallel", "init_ddp")) == TARGET.fingerprints[version]
    module, st, undo = patched(version, monkeypatch)
    assert st.state == "verified", st.reason
    assert isinstance(vars(module.MegatronParallel)["init_ddp"], PatchedTwin)
    assert undo.run() == [] and not isinstance(vars(module.MegatronParallel)["init_ddp"], PatchedTwin)


def test_nemo_3_has_no_such_module():
    root = CACHE / "nemo-3.0.0" / "nemo"
    if not root.exists():
        pytest.skip("nemo-toolkit 3.0.0 not installed under compat/.cache")
    assert (root / "lightning").is_dir() and not (root / "lightning" / "megatron_parallel.py").exists()


# -- behaviour: NeMo's own init_ddp, run ----------------------------------------------------------


@pytest.mark.parametrize("version", MEGATRON_FSDP)
def test_off_by_default_nemo_turns_fusion_off(version, monkeypatch, nemo_imports):
    module, st, undo = patched(version, monkeypatch, cfg=config.Config())
    assert st.state == "off" and TARGET.switch_variable in st.reason and not undo.steps
    assert run_init_ddp(module, True).gradient_accumulation_fusion is False
    assert nemo_imports == [WARNING] and FakeFSDP.built_with == [False]


@pytest.mark.parametrize("version", MEGATRON_FSDP)
def test_on_and_ready_nemo_keeps_the_users_fusion(version, monkeypatch, nemo_imports):
    module, st, _ = patched(version, monkeypatch)
    assert st.state == "verified", st.reason
    assert run_init_ddp(module, True).gradient_accumulation_fusion is True
    assert WARNING not in nemo_imports and FakeFSDP.built_with == [True]
    assert run_init_ddp(module, False).gradient_accumulation_fusion is False  # not asked: unchanged
    assert WARNING not in nemo_imports


@pytest.mark.parametrize("states", [
    {**READY, "fsdp-wgrad": "unverified"},
    {**READY, "fsdp-wgrad": "forced"},
    {**READY, "fsdp-wgrad": "off"},
    {**READY, "apex-wgrad": "off"},
    {**READY, "apex-wgrad": "skipped"},
    {**READY, "fsdp-te-overwrite": "off"},
    {**READY, "fsdp-te-overwrite": "replaced"},
    {**READY, "fsdp-wgrad": "compatible", "fsdp-te-overwrite": "not applicable"},
    {},  # gemm_patch reports nothing
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items() if READY.get(k) != v) or "none")
def test_on_but_not_ready_nemo_turns_fusion_off_as_before(states, monkeypatch, nemo_imports):
    module, st, _ = patched("2.7.3", monkeypatch, states)
    assert st.state == "verified"
    assert run_init_ddp(module, True).gradient_accumulation_fusion is False
    assert nemo_imports == [WARNING] and FakeFSDP.built_with == [False]


@pytest.mark.parametrize("states", [
    {**READY, "apex-wgrad": "apex real"},
    {**READY, "fsdp-wgrad": "compatible", "apex-wgrad": "compatible", "fsdp-te-overwrite": "compatible"},
    {**READY, "fsdp-te-overwrite": "not applicable"},  # megatron-core 0.14: no overwrite flag
])
def test_other_ready_states_keep_it(states, monkeypatch, nemo_imports):
    module, _, _ = patched("2.7.3", monkeypatch, states)
    assert run_init_ddp(module, True).gradient_accumulation_fusion is True and nemo_imports == []


def test_a_config_without_the_attribute_is_left_to_nemo(monkeypatch, nemo_imports):
    module, _, _ = patched("2.7.3", monkeypatch)
    assert run_init_ddp(module, None).gradient_accumulation_fusion is False and nemo_imports == [WARNING]


def test_a_fault_reading_the_states_leaves_it_to_nemo(monkeypatch, nemo_imports):
    module, _, _ = patched("2.7.3", monkeypatch)
    monkeypatch.setattr(nemo_fsdp_gaf, "_live_states", lambda: 1 / 0)
    assert run_init_ddp(module, True).gradient_accumulation_fusion is False and nemo_imports == [WARNING]


def test_reverted_nemo_turns_fusion_off_again(monkeypatch, nemo_imports):
    module, _, undo = patched("2.7.3", monkeypatch)
    assert undo.run() == []
    assert run_init_ddp(module, True).gradient_accumulation_fusion is False and nemo_imports == [WARNING]


def test_the_twin_keeps_nemos_file_and_lines(monkeypatch):
    module, _, _ = patched("2.7.3", monkeypatch)
    installed = vars(module.MegatronParallel)["init_ddp"]
    twin, original = installed._self_gemm_patch_twin, installed.__wrapped__
    assert twin.__code__.co_filename == original.__code__.co_filename == module.__file__
    assert twin.__code__.co_firstlineno == original.__code__.co_firstlineno
    assert twin.__qualname__ == "MegatronParallel.init_ddp" and twin.__globals__ is module.__dict__
    assert "_gemm_patch_nemo_gaf" not in vars(module)


# -- the gate: unknown code is left alone --------------------------------------------------------


def _edited_copy(tmp_path: Path, old: str, new: str) -> Path:
    text = source_file("2.7.3").read_text()
    assert text.count(old) == 1
    path = tmp_path / "megatron_parallel.py"
    path.write_text(text.replace(old, new))
    return path


def test_changed_init_ddp_is_unverified_and_left_alone(tmp_path, monkeypatch):
    path = _edited_copy(tmp_path, "disable_bucketing = (model_chunk_idx > 0) or",
                        "disable_bucketing = (model_chunk_idx > 1) or")
    module = nemo_module(path)
    st, undo = TARGET.patch(module, "2.7.3", ON)
    assert st.state == "unverified" and "differs from the recorded" in st.reason and not undo.steps
    with pytest.raises(Exception, match="GEMM_PATCH_STRICT"):
        TARGET.patch(module, "2.7.3", dataclasses.replace(ON, strict=True))


def test_edited_code_without_the_if_is_unverified_not_not_applicable(tmp_path):
    # Code without the site that no table records may hold the defect in another form: it is
    # left alone and said so (unverified), never called "not applicable".
    path = _edited_copy(tmp_path, 'if getattr(module.config, "gradient_accumulation_fusion", True):',
                        'if getattr(module.config, "gradient_accumulation_fusion", False):')
    st, undo = TARGET.patch(nemo_module(path), "9.9.9", ON)
    assert st.state == "unverified" and "not one" in st.reason and not undo.steps, (st.state, st.reason)


def test_a_replaced_init_ddp_is_skipped(monkeypatch):
    module = nemo_module(source_file("2.7.3"))
    module.MegatronParallel.init_ddp = lambda self: None
    st, undo = TARGET.patch(module, "2.7.3", ON)
    assert st.state == "skipped" and not undo.steps


def test_fused_path_ready_names_what_is_missing():
    ready, why = fused_path_ready({**READY, "apex-wgrad": "not applicable"})
    assert not ready and why == "apex-wgrad is not applicable"


# -- through apply(), in a fresh interpreter: the variable, the registry, the summary ------------

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import test_nemo_target as t
from gemm_patch.engine import patcher
from gemm_patch.engine.target import TargetStatus
sys.modules[t.MODULE] = module = t.nemo_module(t.source_file("2.7.3"))
import gemm_patch
st = {{s.name: s for s in gemm_patch.apply().targets}}["nemo-fsdp-gaf"]
print(st.state, "|", st.reason)
print(type(module.MegatronParallel.__dict__["init_ddp"]).__name__)
for name in t.READY:  # no megatron-core here: its targets' states, as a patched one reports them
    patcher._state.statuses[name] = TargetStatus(name, "m", "verified", "test")
warnings = t.install_stand_ins(dict.__setitem__)
print(t.run_init_ddp(module, True).gradient_accumulation_fusion, warnings == [t.WARNING])
gemm_patch.revert()
print(type(module.MegatronParallel.__dict__["init_ddp"]).__name__)
"""


def test_its_variable_is_off_unless_set_to_1():
    var = TARGET.switch_variable
    assert var == "GEMM_PATCH_NEMO_FSDP_GAF" and TARGET.default_on is False
    for value, on in ((None, False), ("", False), ("0", False), ("1", True), ("yes", True)):
        env = {} if value is None else {var: value}
        assert config.load(env, switches={var: TARGET.default_on}).switch_on(var, TARGET.default_on) is on
    with pytest.raises(config.ConfigError, match="unset means 0"):
        config.load({var: "maybe"}, switches={var: TARGET.default_on})


@pytest.mark.parametrize("variable", [None, "1"])
def test_apply_patches_it_only_where_its_variable_is_1(variable):
    source_file("2.7.3")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH") and k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    if variable is not None:
        env["GEMM_PATCH_NEMO_FSDP_GAF"] = variable
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=str(ROOT / "tests"))], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    state, kind, ran, after = out.stdout.splitlines()
    if variable == "1":
        # No nemo-toolkit metadata here: judged by fingerprint alone.
        assert state.startswith("compatible |") and kind == "PatchedTwin" and after == "function"
        assert ran == "True False"  # kept, and no NeMo warning
    else:
        assert state.startswith("off |") and kind == after == "function"
        assert ran == "False True"  # NeMo's own behaviour
