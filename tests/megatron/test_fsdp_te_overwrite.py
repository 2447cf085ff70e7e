"""The fsdp-te-overwrite target against the real megatron-core release on PYTHONPATH
(compat/matrix.py passes the state each target's fingerprint table implies).

Megatron-FSDP's ``MegatronFSDP.all_gather_and_wait_parameters_ready`` sets
``param.overwrite_main_grad = True`` on every parameter it unshards; Transformer Engine's linear
layers read that flag in forward and overwrite ``main_grad`` in backward. The target resets it
where ``main_grad`` is the persistent buffer. The behavioural tests run the release's own method
(through the installed wrapper) on an instance made with ``object.__new__`` that carries only the
attributes the method reads (a real MegatronFSDP needs CUDA and process groups), with parameters
carrying Megatron-FSDP's ``_gbuf`` interface (docs/how-it-works.md).
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys

import pytest
from conftest import expected
from megatron_cpu import unknown_release

# The CPU stand-ins for Megatron-FSDP's instance and parameters, shared with the standalone
# package's tests (appended, so this folder's conftest stays the one imported).
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "megatron_fsdp"))
import unshard as fsdp_cpu  # noqa: E402
from unshard import fsdp_param  # noqa: E402

import gemm_patch
from gemm_patch.engine import detection

pytestmark = pytest.mark.proves("fsdp-te-overwrite")

MODULE = "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp"
METHOD = "all_gather_and_wait_parameters_ready"
EXPECT = expected("fsdp-te-overwrite")
PATCHED = EXPECT in ("verified", "compatible", "forced")
needs_patch = pytest.mark.skipif(not PATCHED, reason=f"fsdp-te-overwrite is {EXPECT} on this release")

try:
    fsdp = importlib.import_module(MODULE)
except ImportError:
    fsdp = None
MegatronFSDP = getattr(fsdp, "MegatronFSDP", None)


def target_state():
    return {t.name: t for t in gemm_patch.status().targets}["fsdp-te-overwrite"]


@pytest.fixture
def patched():
    gemm_patch.apply()
    yield


@pytest.fixture
def unpatched():
    gemm_patch.revert()
    yield
    gemm_patch.apply()


def megatron_fsdp(strategy: str = "optim_grads_params", params=()):
    """This release's MegatronFSDP without __init__ (tests/megatron_fsdp/unshard.py)."""
    return fsdp_cpu.megatron_fsdp(MegatronFSDP, strategy, params)


def unshard(obj, params, **kwargs):
    return obj.all_gather_and_wait_parameters_ready(params, **kwargs)


def test_state_is_what_the_matrix_expects(patched):
    st = target_state()
    assert st.state == EXPECT, st.reason
    assert st.version is not None


def test_release_layout_matches_the_matrix():
    """Where the method and its statement are, as the expected state claims."""
    if EXPECT == "not applicable" and fsdp is None:
        return  # megatron-core 0.13.1: no Megatron-FSDP module at all
    assert MegatronFSDP is not None
    source = inspect.getsource(inspect.unwrap(vars(MegatronFSDP)[METHOD]))
    assert ("param.overwrite_main_grad = True" in source) == PATCHED
    assert list(inspect.signature(inspect.unwrap(vars(MegatronFSDP)[METHOD])).parameters)[:2] == ["self", "params"]


@needs_patch
def test_persistent_buffer_flag_reset_sharded_multi_rank_kept(patched):
    persistent, fresh, plain = fsdp_param(False), fsdp_param(True), fsdp_param(None)
    obj = megatron_fsdp(params=[persistent, fresh, plain])
    unshard(obj, [persistent, fresh, plain])
    # The release's own method ran: it gathered and waited, and set its other attributes.
    assert obj.all_gather_pipeline.gathered == [[persistent, fresh, plain]]
    assert obj.all_gather_pipeline.waited == [0, 1, 2]
    assert all(p.__fsdp_param__ is True and p.grad_added_to_main_grad is False
               for p in (persistent, fresh, plain))
    assert persistent.overwrite_main_grad is False, "TE would overwrite the persistent main_grad"
    assert fresh.overwrite_main_grad is True, "a fresh bucket must still be overwritten"
    assert plain.overwrite_main_grad is True, "not Megatron-FSDP's buffer: left as the method set it"


@needs_patch
def test_every_unshard_resets_again(patched):
    param = fsdp_param(False)
    obj = megatron_fsdp(params=[param])
    wrapper = vars(MegatronFSDP)[METHOD]
    before = wrapper.resets
    backward = {"bwd": True} if "bwd" in inspect.signature(wrapper).parameters else {}
    for kwargs in ({}, backward, {}):
        param.overwrite_main_grad = True  # what TE or an earlier unshard may leave behind
        unshard(obj, [param], **kwargs)
        assert param.overwrite_main_grad is False
    assert wrapper.resets == before + 3


@needs_patch
@pytest.mark.parametrize("how", ["keyword", "generator", "through_the_class"])
def test_params_passed_any_way(patched, how):
    params = [fsdp_param(False), fsdp_param(True)]
    obj = megatron_fsdp(params=params)
    if how == "keyword":
        obj.all_gather_and_wait_parameters_ready(params=params, wait_bucket_ready=False)
    elif how == "generator":
        obj.all_gather_and_wait_parameters_ready(p for p in params)
    else:
        MegatronFSDP.all_gather_and_wait_parameters_ready(obj, params)
    assert [p.overwrite_main_grad for p in params] == [False, True]
    assert obj.all_gather_pipeline.gathered == [params]


@needs_patch
def test_no_shard_sets_no_flag_and_gains_none(patched):
    param = fsdp_param(False)
    obj = megatron_fsdp("no_shard", [param])
    assert unshard(obj, [param]) is None
    assert not hasattr(param, "overwrite_main_grad") and obj.all_gather_pipeline.gathered == []


@needs_patch
def test_unpatched_release_sets_the_flag_on_the_persistent_buffer(unpatched):
    """The upstream behaviour the target departs from (and what the tests above would see
    without the reset)."""
    param = fsdp_param(False)
    unshard(megatron_fsdp(params=[param]), [param])
    assert param.overwrite_main_grad is True


def test_revert_restores_the_original_object_and_apply_twice_is_a_no_op():
    if MegatronFSDP is None:
        pytest.skip("no Megatron-FSDP in this release")
    gemm_patch.revert()
    original = vars(MegatronFSDP)[METHOD]
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
    assert target_state().state == "off"
    gemm_patch.apply()
    assert target_state().state == EXPECT


@needs_patch
def test_switched_off_by_the_variable(monkeypatch):
    gemm_patch.revert()
    original = vars(MegatronFSDP)[METHOD]
    monkeypatch.setenv("GEMM_PATCH_TE_OVERWRITE", "0")
    try:
        gemm_patch.apply()
        st = target_state()
        assert st.state == "off" and "GEMM_PATCH_TE_OVERWRITE=0" in st.reason, st.reason
        assert vars(MegatronFSDP)[METHOD] is original
        assert {t.name: t.state for t in gemm_patch.status().targets}["fsdp-wgrad"] != "off"
    finally:
        monkeypatch.delenv("GEMM_PATCH_TE_OVERWRITE")
        gemm_patch.revert()
        gemm_patch.apply()
    assert vars(MegatronFSDP)[METHOD].__wrapped__ is original


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=240)


_IMPORTS = f"""
import gemm_patch
import megatron.core.tensor_parallel.layers
import {MODULE}
print({{t.name: t.state for t in gemm_patch.status().targets}}["fsdp-te-overwrite"])
"""


@needs_patch
@pytest.mark.parametrize("rank", ["0", pytest.param("1", marks=pytest.mark.common_machinery)])
def test_one_summary_line_and_at_most_one_more_on_rank_0(rank):
    out = _run(_IMPORTS, RANK=rank, GEMM_PATCH_LOG_LEVEL="INFO")
    assert out.returncode == 0 and out.stdout.split()[-1] == EXPECT, out.stderr
    info = [line for line in out.stderr.splitlines() if line.startswith("[gemm_patch] INFO:")]
    if rank == "1":
        assert info == [], out.stderr
        return
    # megatron.core.distributed imports Megatron-FSDP's module, so either line may come first.
    assert 1 <= len(info) <= 2, out.stderr
    assert sum("fsdp-wgrad" in line for line in info) == 1, out.stderr
    assert sum(f"fsdp-te-overwrite {EXPECT}" in line for line in info) == 1, out.stderr


_UNKNOWN_RELEASE = unknown_release("fsdp-te-overwrite") + f"""
import gemm_patch
try:
    import megatron.core.tensor_parallel.layers
    import {MODULE}
except gemm_patch.GemmPatchError as exc:
    print("refused:", exc)
print({{t.name: t.state for t in gemm_patch.status().targets}}["fsdp-te-overwrite"])
"""


@needs_patch
@pytest.mark.parametrize("mode", [pytest.param("default", marks=pytest.mark.common_machinery),
                                  pytest.param("strict", marks=pytest.mark.common_machinery), "allow"])
def test_unknown_code_is_left_alone_unless_allowed_and_refused_in_strict_mode(mode):
    out = _run(_UNKNOWN_RELEASE, GEMM_PATCH_STRICT="1" if mode == "strict" else "0",
               GEMM_PATCH_ALLOW_UNVERIFIED="1" if mode == "allow" else "0")
    assert out.returncode == 0, out.stderr
    state = out.stdout.split()[-1]
    if mode == "strict":
        assert "refused:" in out.stdout and "not a verified release" in out.stdout, out.stdout
        assert state != "unverified"
    elif mode == "default":
        assert state == "unverified", out.stdout
        assert sum("fsdp-te-overwrite unverified" in line for line in out.stderr.splitlines()) == 1, out.stderr
    else:
        assert state == "forced", out.stdout


def test_version_is_megatron_cores():
    st = target_state()
    assert st.version == detection.distribution_version("megatron-core")
