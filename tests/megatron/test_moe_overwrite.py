"""The moe-te-overwrite target against the real megatron-core release on PYTHONPATH.

megatron-core 0.19's fused grouped MLP (``TEGroupedMLP`` on Transformer Engine's op fuser) runs,
before every forward, a hook that first calls each expert linear's own pre-forward hooks
(Megatron-FSDP's unshard: ``MegatronFSDP.all_gather_and_wait_parameters_ready``, where
fsdp-te-overwrite resets ``overwrite_main_grad`` on persistent buffers) and then
``TEGroupedMLP._ensure_main_grad``, which sets the flag back to True. TE's GroupedLinear op then
overwrites ``main_grad`` in backward (``get_accumulate_flag_in_param``): each expert keeps only
the last micro-batch over a persistent buffer.

The behavioural tests run the release's own hook (``_make_fused_impl_pre_forward_hook``) on a
``TEGroupedMLP`` made with ``object.__new__`` that holds only its two expert linears, each with a
pre-forward hook that runs the release's own ``all_gather_and_wait_parameters_ready`` (on a
``MegatronFSDP`` holding only what that method reads) over parameters carrying Megatron-FSDP's
``_gbuf`` / ``get_main_grad`` interface. TE's fused GroupedLinear needs CUDA; its rule (add
unless the flag is True) is applied by ``te_grouped_wgrad`` below to show what reaches
``main_grad``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import pytest
from conftest import EXPECTED, applied_without, torch

import gemm_patch
from gemm_patch.engine import detection
from gemm_patch.targets.te_overwrite import MOE_TARGET as TARGET

pytestmark = pytest.mark.proves("moe-te-overwrite")

experts = pytest.importorskip("megatron.core.transformer.moe.experts")
try:
    fsdp = importlib.import_module("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp")
except ImportError:
    fsdp = None

NAME = TARGET.name
METHOD = TARGET.attribute
TEGroupedMLP = getattr(experts, "TEGroupedMLP", None)
EXPECT = EXPECTED.get(NAME) or TARGET.expected_state(detection.distribution_version("megatron-core"))
PATCHED = EXPECT in ("verified", "compatible", "forced")
needs_patch = pytest.mark.skipif(not PATCHED, reason=f"{NAME} is {EXPECT} on this release")

@pytest.fixture(scope="module", autouse=True)
def registered():
    gemm_patch.revert()
    gemm_patch.apply()
    yield


@pytest.fixture
def without_this_target():
    """Every other target applied (fsdp-te-overwrite included), this one not."""
    with applied_without(NAME):
        yield


def target_state():
    return {t.name: t for t in gemm_patch.status().targets}[NAME]


# -- Megatron-FSDP's side, as the release's own code leaves it ---------------------------------

class GradBuffer:
    """``fetch_bucket``: the persistent buffer's own storage when the data is not distributed,
    else a fresh unzeroed bucket (NaN here)."""

    def __init__(self, shape, is_data_distributed: bool) -> None:
        self.is_data_distributed = is_data_distributed
        self.data = torch.zeros(shape)

    def fetch_bucket(self):
        return self.data if not self.is_data_distributed else torch.full_like(self.data, float("nan"))


def fsdp_param(distributed: bool | None, shape=(6, 4)):
    """A parameter as ParamAndGradBuffer leaves it (``_gbuf``, ``get_main_grad``); None: not
    Megatron-FSDP's (no ``_gbuf``; the flag is set by hand as another wrapper might)."""
    param = torch.nn.Parameter(torch.zeros(shape))
    if distributed is not None:
        param._gbuf = GradBuffer(shape, distributed)
        param.get_main_grad = lambda: param._gbuf.fetch_bucket()
    return param


def megatron_fsdp(params, strategy: str = "optim_grads_params"):
    """A MegatronFSDP without __init__, holding what all_gather_and_wait_parameters_ready reads."""
    class Pipeline:
        def __init__(self):
            self.gathered = []

        def all_gather_params(self, params, **kwargs):
            self.gathered.append(list(params))

        def wait_bucket_ready(self, bucket_id, *args):
            pass

    obj = object.__new__(fsdp.MegatronFSDP)
    vars(obj).update(
        data_parallel_sharding_strategy=strategy, all_gather_pipeline=Pipeline(),
        suggested_AG_prefetch_size=None, dist_index=types.SimpleNamespace(use_hybrid_fsdp=False),
        ddp_config=types.SimpleNamespace(outer_dp_sharding_strategy="no_shard"), microbatch_count=0,
        model_auto_sync=False,
        param_and_grad_buffer=types.SimpleNamespace(param_to_param_group={p: i for i, p in enumerate(params)}),
    )
    return obj


class ExpertLinear(torch.nn.Module):
    """The part of TEGroupedLinear the hook reads: ``fuse_wgrad_accumulation`` and per-expert
    weights ``weight0..``."""

    def __init__(self, params, fuse_wgrad_accumulation: bool = True) -> None:
        super().__init__()
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        for i, param in enumerate(params):
            self.register_parameter(f"weight{i}", param)


def grouped_mlp(fc1_params, fc2_params, strategy: str = "optim_grads_params", fuse: bool = True):
    """A TEGroupedMLP without __init__ holding two expert linears, each with Megatron-FSDP's
    unshard as its pre-forward hook; returns it, the release's fused-ops pre-forward hook and
    the MegatronFSDP."""
    params = [*fc1_params, *fc2_params]
    mfsdp = megatron_fsdp(params, strategy)
    fc1, fc2 = ExpertLinear(fc1_params, fuse), ExpertLinear(fc2_params, fuse)
    for linear in (fc1, fc2):
        linear.register_forward_pre_hook(
            lambda module, args: mfsdp.all_gather_and_wait_parameters_ready(list(module.parameters(recurse=False))))
    mlp = object.__new__(TEGroupedMLP)
    vars(mlp).update(linear_fc1=fc1, linear_fc2=fc2)
    return mlp, mlp._make_fused_impl_pre_forward_hook(), mfsdp


def te_grouped_wgrad(param, wgrad):
    """Transformer Engine's GroupedLinear op with accumulate_into_main_grad=True: overwrite
    ``main_grad`` when ``overwrite_main_grad`` is True, add otherwise
    (transformer_engine/pytorch/ops/_common.py ``get_accumulate_flag_in_param``)."""
    if getattr(param, "overwrite_main_grad", False):
        param.main_grad.copy_(wgrad)
    else:
        param.main_grad.add_(wgrad)


def micro_batches(hook, params, count: int = 3):
    """``count`` forward/backward rounds: the hook before each forward, then each weight's
    wgrad ``k + 1`` reaches main_grad by TE's rule; returns the expected sums."""
    for k in range(count):
        hook(None)
        for param in params:
            te_grouped_wgrad(param, torch.full(param.shape, float(k + 1)))
    return float(sum(range(1, count + 1))), float(count)


# -- the tests ------------------------------------------------------------------------------

def test_state_is_what_the_matrix_expects():
    st = target_state()
    assert st.state == EXPECT, st.reason
    assert st.version == detection.distribution_version("megatron-core")


def test_release_layout_matches_the_expectation():
    """The static method and its statement exist exactly where the target claims them."""
    method = vars(TEGroupedMLP).get(METHOD) if TEGroupedMLP is not None else None
    if not PATCHED:
        assert method is None or "overwrite_main_grad = True" not in _source(method)
        return
    assert "param.overwrite_main_grad = True" in _source(method)
    assert isinstance(getattr(method, "__wrapped__", method), staticmethod)


def _source(method) -> str:
    import inspect

    return inspect.getsource(inspect.unwrap(getattr(method, "__wrapped__", method).__func__))


@needs_patch
def test_expert_weights_over_a_persistent_buffer_sum_every_micro_batch():
    persistent, fresh = [fsdp_param(False), fsdp_param(False)], [fsdp_param(True), fsdp_param(True)]
    mlp, hook, mfsdp = grouped_mlp(persistent, fresh)
    total, _ = micro_batches(hook, persistent)
    # The release's own code ran: Megatron-FSDP unsharded both linears, _ensure_main_grad
    # attached main_grad from get_main_grad().
    assert mfsdp.all_gather_pipeline.gathered == [persistent, fresh] * 3
    for param in persistent:
        assert param.overwrite_main_grad is False
        assert param.main_grad.data_ptr() == param._gbuf.data.data_ptr()
        assert torch.equal(param._gbuf.data, torch.full(param.shape, total)), param._gbuf.data
    for param in fresh:
        assert param.overwrite_main_grad is True, "a fresh bucket must still be overwritten"


@needs_patch
def test_without_the_target_the_hook_puts_the_flag_back(without_this_target):
    """What upstream does even with fsdp-te-overwrite in place: _ensure_main_grad sets the flag
    again after the unshard reset it, and the persistent buffer keeps the last micro-batch
    (the test above fails the same way with the target off)."""
    assert {t.name: t.state for t in gemm_patch.status().targets}["fsdp-te-overwrite"] == "verified"
    persistent = [fsdp_param(False)]
    mlp, hook, mfsdp = grouped_mlp(persistent, [fsdp_param(True)])
    mlp.linear_fc1._forward_pre_hooks[next(iter(mlp.linear_fc1._forward_pre_hooks))](mlp.linear_fc1, None)
    assert persistent[0].overwrite_main_grad is False, "fsdp-te-overwrite reset it in the unshard"
    _, last = micro_batches(hook, persistent)
    assert persistent[0].overwrite_main_grad is True
    assert torch.equal(persistent[0]._gbuf.data, torch.full((6, 4), last))


@needs_patch
def test_not_megatron_fsdp_and_fusion_off_are_left_as_the_method_leaves_them():
    plain = fsdp_param(None)
    plain.overwrite_main_grad = True
    plain.main_grad = torch.zeros(6, 4)
    TEGroupedMLP._ensure_main_grad(ExpertLinear([plain]))
    assert plain.overwrite_main_grad is True
    persistent = fsdp_param(False)
    persistent.overwrite_main_grad = True
    TEGroupedMLP._ensure_main_grad(ExpertLinear([persistent], fuse_wgrad_accumulation=False))
    assert persistent.overwrite_main_grad is True and not hasattr(persistent, "main_grad")


@needs_patch
def test_every_call_resets_again_through_the_class_and_by_keyword():
    wrapper = vars(TEGroupedMLP)[METHOD]
    before = wrapper.resets
    param = fsdp_param(False)
    param.overwrite_main_grad = True
    TEGroupedMLP._ensure_main_grad(ExpertLinear([param]))
    assert param.overwrite_main_grad is False
    param.overwrite_main_grad = True
    TEGroupedMLP._ensure_main_grad(linear_module=ExpertLinear([param]))
    assert param.overwrite_main_grad is False
    assert wrapper.resets == before + 2


def test_revert_restores_the_original_object_and_apply_twice_is_a_no_op():
    if TEGroupedMLP is None:
        pytest.skip("no TEGroupedMLP in this release")
    gemm_patch.revert()
    original = vars(TEGroupedMLP).get(METHOD)
    gemm_patch.apply()
    installed = vars(TEGroupedMLP).get(METHOD)
    gemm_patch.apply()
    assert vars(TEGroupedMLP).get(METHOD) is installed
    if PATCHED:
        assert installed is not original and installed.__wrapped__ is original
        assert installed._self_gemm_patch_target == NAME
    else:
        assert installed is original
    gemm_patch.revert()
    assert vars(TEGroupedMLP).get(METHOD) is original
    assert target_state().state == "off"  # reverted: every target reads off, as in 0.1.0
    gemm_patch.apply()
    assert target_state().state == EXPECT


@needs_patch
def test_switched_off_with_fsdp_te_overwrite_by_their_shared_variable(monkeypatch):
    gemm_patch.revert()
    original = vars(TEGroupedMLP)[METHOD]
    monkeypatch.setenv("GEMM_PATCH_TE_OVERWRITE", "0")
    try:
        gemm_patch.apply()
        states = {t.name: t for t in gemm_patch.status().targets}
        assert states[NAME].state == "off" and "GEMM_PATCH_TE_OVERWRITE=0" in states[NAME].reason
        assert states["fsdp-te-overwrite"].state == "off"
        assert vars(TEGroupedMLP)[METHOD] is original
    finally:
        monkeypatch.delenv("GEMM_PATCH_TE_OVERWRITE")
        gemm_patch.revert()
        gemm_patch.apply()
    assert vars(TEGroupedMLP)[METHOD].__wrapped__ is original


_UNKNOWN = f"""
import dataclasses
import gemm_patch.engine.patcher as _p
_p.use_targets(tuple(dataclasses.replace(t, fingerprints={{}}) if t.name == {NAME!r} else t for t in _p.targets()))
_p.apply()
import gemm_patch
import sys
try:
    import megatron.core.transformer.moe.experts
except gemm_patch.GemmPatchError as exc:
    print("refused:", exc)
e = sys.modules.get("megatron.core.transformer.moe.experts")
st = {{t.name: t for t in gemm_patch.status().targets}}[{NAME!r}]
print(type(vars(e.TEGroupedMLP)[{METHOD!r}]).__name__ if e else "-", st.state)
"""


@needs_patch
@pytest.mark.parametrize("mode", ["default", "strict", "allow"])
def test_unknown_code_is_left_alone_unless_allowed_and_refused_in_strict_mode(mode):
    env = {**os.environ, "GEMM_PATCH_STRICT": "1" if mode == "strict" else "0",
           "GEMM_PATCH_ALLOW_UNVERIFIED": "1" if mode == "allow" else "0"}
    out = subprocess.run([sys.executable, "-c", _UNKNOWN], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr
    kind, state = out.stdout.split()[-2:]
    if mode == "strict":
        assert "refused:" in out.stdout and "not a verified release" in out.stdout, out.stdout
    elif mode == "default":
        assert (kind, state) == ("staticmethod", "unverified"), out.stdout
    else:
        assert (kind, state) == ("PatchedExpertFlag", "forced"), out.stdout


def test_fingerprint_table_is_the_targets_own():
    """Each release the matrix expects verified has a line; main's pinned commit is 0.19.2's code."""
    assert TARGET.fingerprints["0.19.0"] == TARGET.fingerprints["0.19.2"]
    assert TARGET.switch_variable == "GEMM_PATCH_TE_OVERWRITE"
