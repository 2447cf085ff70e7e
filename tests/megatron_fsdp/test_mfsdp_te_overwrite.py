"""The mfsdp-te-overwrite target against the standalone megatron-fsdp release on PYTHONPATH
(PyPI ``megatron-fsdp``, imported as ``megatron_fsdp``; compat/matrix.py runs this folder once
per release of compat/matrix.json).

The release's own ``MegatronFSDP.all_gather_and_wait_parameters_ready`` runs through the
installed wrapper: it sets ``param.overwrite_main_grad = True`` on every parameter it unshards,
and the wrapper resets it where ``main_grad`` is the persistent buffer (see
tests/megatron/test_fsdp_te_overwrite.py for megatron-core's copy of the class).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
from conftest import expected, module
from unshard import METHOD, STATEMENT, fsdp_param, megatron_fsdp

import gemm_patch
from gemm_patch.engine import detection
from gemm_patch.targets import by_name

pytestmark = pytest.mark.proves("mfsdp-te-overwrite")

TARGET = by_name("mfsdp-te-overwrite")
EXPECT = expected(TARGET.name)
PATCHED = EXPECT in ("verified", "compatible", "forced")
MegatronFSDP = module.MegatronFSDP
needs_patch = pytest.mark.skipif(not PATCHED, reason=f"{TARGET.name} is {EXPECT} on this release")


def target_state():
    return {t.name: t for t in gemm_patch.status().targets}[TARGET.name]


@pytest.fixture
def patched():
    gemm_patch.apply()
    yield


@pytest.fixture
def unpatched():
    gemm_patch.revert()
    yield
    gemm_patch.apply()


def test_the_standalone_package_alone():
    """The class under test is megatron-fsdp's own (no megatron-core on the path)."""
    assert module.__name__ == TARGET.module == "megatron_fsdp.megatron_fsdp"
    assert detection.distribution_version("megatron-core") is None
    assert MegatronFSDP.__module__ == TARGET.module


def test_state_is_what_the_matrix_expects(patched):
    st = target_state()
    assert st.state == EXPECT, st.reason
    assert st.version == detection.distribution_version("megatron-fsdp")


def test_release_layout_matches_the_expectation():
    """The method exists in every release; the statement the target resets is there exactly
    where the fingerprint table says the target applies."""
    original = inspect.unwrap(vars(MegatronFSDP)[METHOD])
    assert list(inspect.signature(original).parameters)[:2] == ["self", "params"]
    assert (STATEMENT in inspect.getsource(original)) == PATCHED


@needs_patch
@pytest.mark.parametrize("how", ["positional", "keyword", "generator", "through_the_class", "backward"])
def test_persistent_buffer_flag_reset_fresh_bucket_kept(patched, how):
    persistent, fresh, plain = fsdp_param(False), fsdp_param(True), fsdp_param(None)
    params = [persistent, fresh, plain]
    obj = megatron_fsdp(MegatronFSDP, params=params)
    if how == "positional":
        obj.all_gather_and_wait_parameters_ready(params)
    elif how == "keyword":
        obj.all_gather_and_wait_parameters_ready(params=params)
    elif how == "generator":
        obj.all_gather_and_wait_parameters_ready(p for p in params)
    elif how == "through_the_class":
        MegatronFSDP.all_gather_and_wait_parameters_ready(obj, params)
    else:
        if "bwd" not in inspect.signature(inspect.unwrap(vars(MegatronFSDP)[METHOD])).parameters:
            pytest.skip("no bwd argument in this release")
        obj.all_gather_and_wait_parameters_ready(params, bwd=True)
    # The release's own method ran: it gathered, waited and set its other attributes.
    assert obj.all_gather_pipeline.gathered == [params]
    assert obj.all_gather_pipeline.waited == [0, 1, 2]
    assert all(p.__fsdp_param__ is True and p.grad_added_to_main_grad is False for p in params)
    assert persistent.overwrite_main_grad is False, "TE would overwrite the persistent main_grad"
    assert fresh.overwrite_main_grad is True, "a fresh bucket must still be overwritten"
    assert plain.overwrite_main_grad is True, "not Megatron-FSDP's buffer: left as the method set it"


@needs_patch
def test_no_shard_returns_early_and_sets_no_flag(patched):
    param = fsdp_param(False)
    obj = megatron_fsdp(MegatronFSDP, "no_shard", [param])
    assert obj.all_gather_and_wait_parameters_ready([param]) is None
    assert not hasattr(param, "overwrite_main_grad") and obj.all_gather_pipeline.gathered == []


@needs_patch
def test_unpatched_release_sets_the_flag_on_the_persistent_buffer(unpatched):
    """The upstream behaviour the target departs from."""
    param = fsdp_param(False)
    megatron_fsdp(MegatronFSDP, params=[param]).all_gather_and_wait_parameters_ready([param])
    assert param.overwrite_main_grad is True


def test_revert_restores_the_original_object_and_apply_twice_is_a_no_op():
    gemm_patch.revert()
    original = vars(MegatronFSDP)[METHOD]
    if PATCHED:
        assert target_state().state == "off"
    gemm_patch.apply()
    installed = vars(MegatronFSDP)[METHOD]
    gemm_patch.apply()
    assert vars(MegatronFSDP)[METHOD] is installed
    if PATCHED:
        assert installed is not original and installed.__wrapped__ is original
        assert inspect.unwrap(installed) is original and installed.__name__ == METHOD
    else:
        assert installed is original
    gemm_patch.revert()
    assert vars(MegatronFSDP)[METHOD] is original
    gemm_patch.apply()
    assert target_state().state == EXPECT


@needs_patch
def test_switched_off_by_the_variable(monkeypatch):
    gemm_patch.revert()
    original = vars(MegatronFSDP)[METHOD]
    monkeypatch.setenv(TARGET.switch_variable, "0")
    try:
        gemm_patch.apply()
        st = target_state()
        assert st.state == "off" and f"{TARGET.switch_variable}=0" in st.reason, st.reason
        assert vars(MegatronFSDP)[METHOD] is original
    finally:
        monkeypatch.delenv(TARGET.switch_variable)
        gemm_patch.revert()
        gemm_patch.apply()
    assert vars(MegatronFSDP)[METHOD].__wrapped__ is original


def test_a_fresh_process_is_patched_on_import_with_one_summary_line():
    """What a user sees: ``import gemm_patch`` then ``import megatron_fsdp`` (which imports the
    module) patches it, and rank 0 logs one line naming megatron-fsdp's release."""
    code = ("import gemm_patch, megatron_fsdp\n"
            f"print({{t.name: t.state for t in gemm_patch.status().targets}}[{TARGET.name!r}])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={**env, "RANK": "0", "GEMM_PATCH_LOG_LEVEL": "INFO"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == EXPECT, out.stdout
    version = detection.distribution_version("megatron-fsdp")
    lines = [line for line in out.stderr.splitlines() if line.startswith("[gemm_patch] INFO:")]
    assert len(lines) == 1, out.stderr
    if EXPECT == "not applicable":  # status() says so; the line names only what applies
        assert lines[0].startswith(f"[gemm_patch] INFO: megatron-fsdp {version}: ") and TARGET.name not in lines[0]
    else:
        assert f"megatron-fsdp {version}: {TARGET.name} {EXPECT}" in lines[0], lines
