"""The targets for Megatron-LM main (unreleased megatron-core 0.20), against main's own source at
the pinned commit, on the CPU.

main's megatron-core reports "0.20.0" (plus "+<short hash>" inside a git checkout): the version
0.20.0 itself will report. The targets key its fingerprints by the pinned commit instead
("main@<8 hex>"), so main reads "compatible" (identical to that commit's code), never "verified"
for a release that does not exist yet.

main's source is not in this repository. compat/megatron_lm.py prepares it once under compat/.cache (untracked):
``megatron/core`` at the pinned commit as ``mcore-main-<8 hex>/`` (a package tree, as
``pip install --target`` lays it out; main's optional C++ helper is not needed), and its
``megatron_fsdp`` as ``mfsdp-main-<8 hex>/`` with the dist-info metadata pip would write. The
source comes from ``GEMM_PATCH_MEGATRON_LM`` (a Megatron-LM clone, bare or not, holding the
commit), else from GitHub's tarball of the commit; where neither is reachable (CI reaches PyPI,
maybe not GitHub) the tests skip and say so.

One child interpreter (main on its sys.path) runs every scenario through megatron's own code and
prints JSON; the tests below read it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gemm_patch.targets import fsdp_wgrad, one_rank_scale, te_overwrite
from gemm_patch.upstream import megatron_main

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "compat"))
import megatron_lm  # noqa: E402

pytestmark = pytest.mark.proves("fsdp-wgrad-gemm", "fsdp-te-overwrite-by-strategy", "mfsdp-te-overwrite-by-strategy",
                                "moe-te-overwrite", "fsdp-one-rank-scale", "mfsdp-one-rank-scale")

# compat/adopt.py tests another commit's code against main's tables through this variable.
COMMIT = os.environ.get("GEMM_PATCH_MAIN_COMMIT") or megatron_main.COMMIT

MAIN_TARGETS = ("fsdp-wgrad-gemm", "fsdp-te-overwrite-by-strategy", "mfsdp-te-overwrite-by-strategy",
                "moe-te-overwrite")


def test_every_main_target_pins_the_same_commit():
    assert megatron_main.RELEASE == f"main@{megatron_main.COMMIT[:8]}"
    for target in (fsdp_wgrad.GEMM_TARGET, te_overwrite.BY_STRATEGY_TARGET, te_overwrite.BY_STRATEGY_STANDALONE,
                   te_overwrite.MOE_TARGET, one_rank_scale.TARGET, one_rank_scale.STANDALONE):
        assert megatron_main.RELEASE in target.fingerprints
        assert "0.20.0" not in target.fingerprints, "0.20.0 is not released: main is keyed by its commit"


# -- the child: every scenario through main's own code ------------------------------------------

DRIVER = r'''
import dataclasses, json, os, sys, types
import torch
import gemm_patch, gemm_patch.engine.patcher as p
from gemm_patch.engine import detection
from gemm_patch.targets import fsdp_wgrad, te_overwrite

MINE = (fsdp_wgrad.GEMM_TARGET, te_overwrite.BY_STRATEGY_TARGET, te_overwrite.BY_STRATEGY_STANDALONE,
        te_overwrite.MOE_TARGET)
gemm_patch.apply()

import megatron.core.tensor_parallel.layers as layers
import megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp as mcore_fsdp
import megatron.core.transformer.moe.experts as experts
import megatron_fsdp.megatron_fsdp as standalone_fsdp

torch.cuda.current_device = lambda: "cpu"  # megatron's dummy wgrad without TE
R = {"versions": {c: detection.distribution_version(c) for c in ("megatron-core", "megatron-fsdp")}}

def states():
    return {t.name: [t.state, t.reason] for t in gemm_patch.status().targets}

R["states"] = states()

# -- fsdp-wgrad-gemm: megatron's own autograd function, Megatron-FSDP's main_grad ---------------
class GradBuffer:
    """fetch_bucket: the persistent storage, or this backward's bucket (allocated unzeroed, NaN
    here, on first use; reduce-scattered and dropped after the backward: ``current = None``)."""
    def __init__(self, numel, distributed):
        self.is_data_distributed = distributed
        self.data = torch.zeros(numel)
        self.buckets, self.current = [], None
    def fetch_bucket(self):
        if not self.is_data_distributed:
            return self.data
        if self.current is None:
            self.current = torch.full_like(self.data, float("nan"))
            self.buckets.append(self.current)
        return self.current

def weight(distributed, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(40, 32, generator=g).to(torch.bfloat16))
    w.__fsdp_param__, w.grad_added_to_main_grad, w.overwrite_main_grad = True, False, True
    w._gbuf = GradBuffer(w.numel(), distributed)
    w.get_main_grad = lambda: w._gbuf.fetch_bucket().view(w.shape)
    return w

def layer(x, w):
    return layers.linear_with_grad_accumulation_and_async_allreduce(
        x, w, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False)

def micro_batches(w, n, uses=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    exact = []
    for _ in range(n):
        xs = [torch.randn(48, 32, generator=g).to(torch.bfloat16) for _ in range(uses)]
        ys = [layer(x, w) for x in xs]
        gos = [torch.randn(y.shape, generator=g).to(torch.bfloat16) for y in ys]
        torch.autograd.backward(ys, gos)
        exact.append(sum(go.double().t() @ x.double() for go, x in zip(gos, xs)))
        w.grad, w.grad_added_to_main_grad = None, False  # Megatron-FSDP's _grad_acc
        w._gbuf.current = None  # ... and the bucket's reduce-scatter
    return exact

def rel(got, ref):
    got = got.double().view(ref.shape)
    return float("nan") if torch.isnan(got).any() else ((got - ref).norm() / ref.norm()).item()

def wgrad_cases():
    out = {}
    w = weight(False)
    ex = micro_batches(w, 4)
    out["persistent_vs_sum"], out["persistent_vs_last"] = rel(w._gbuf.data, sum(ex)), rel(w._gbuf.data, ex[-1])
    w = weight(True)
    ex = micro_batches(w, 3)
    out["fresh_vs_each"] = max(rel(b, e) for b, e in zip(w._gbuf.buckets, ex))
    out["fresh_persistent_untouched"] = int(torch.count_nonzero(w._gbuf.data))
    w = weight(True)
    ex = micro_batches(w, 1, uses=2)  # one weight, two uses in one backward, one fresh bucket
    out["twice_buckets"], out["twice_vs_sum"] = len(w._gbuf.buckets), rel(w._gbuf.buckets[0], ex[0])
    return out

# -- fsdp-te-overwrite-by-strategy (+ standalone): the release's own unshard ----------------------
def fsdp_obj(module, strategy, params):
    class Pipeline:
        def all_gather_params(self, params, **kw): pass
        def wait_bucket_ready(self, *a): pass
    o = object.__new__(module.MegatronFSDP)
    vars(o).update(data_parallel_sharding_strategy=strategy, all_gather_pipeline=Pipeline(),
                   suggested_AG_prefetch_size=None, dist_index=types.SimpleNamespace(use_hybrid_fsdp=False),
                   ddp_config=types.SimpleNamespace(outer_dp_sharding_strategy="no_shard"),
                   microbatch_count=0, model_auto_sync=False,
                   param_and_grad_buffer=types.SimpleNamespace(
                       param_to_param_group={q: i for i, q in enumerate(params)}))
    return o

def flag_cases(module):
    out = {}
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        for kind, distributed in (("persistent", False), ("fresh", True), ("plain", None)):
            q = torch.nn.Parameter(torch.zeros(2))
            if distributed is not None:
                q._gbuf = types.SimpleNamespace(is_data_distributed=distributed)
            fsdp_obj(module, strategy, [q]).all_gather_and_wait_parameters_ready([q])
            out[f"{strategy}/{kind}"] = q.overwrite_main_grad
    return out

# -- moe-te-overwrite: the fused grouped MLP's own pre-forward hook -----------------------------
def moe_case():
    class Linear(torch.nn.Module):
        def __init__(self, params):
            super().__init__()
            self.fuse_wgrad_accumulation = True
            for i, q in enumerate(params):
                self.register_parameter(f"weight{i}", q)
    persistent = torch.nn.Parameter(torch.zeros(3, 2))
    persistent._gbuf = GradBuffer(6, False)
    persistent.get_main_grad = lambda: persistent._gbuf.fetch_bucket().view(3, 2)
    fresh = torch.nn.Parameter(torch.zeros(3, 2))
    fresh._gbuf = GradBuffer(6, True)
    fresh.get_main_grad = lambda: fresh._gbuf.fetch_bucket().view(3, 2)
    fsdp = fsdp_obj(mcore_fsdp, "optim_grads_params", [persistent, fresh])
    fc1, fc2 = Linear([persistent]), Linear([fresh])
    for lin in (fc1, fc2):
        lin.register_forward_pre_hook(
            lambda m, a: fsdp.all_gather_and_wait_parameters_ready(list(m.parameters(recurse=False))))
    mlp = object.__new__(experts.TEGroupedMLP)
    vars(mlp).update(linear_fc1=fc1, linear_fc2=fc2)
    hook = mlp._make_fused_impl_pre_forward_hook()
    for k in range(3):  # TE's GroupedLinear rule: overwrite when the flag is True, else add
        hook(None)
        if persistent.overwrite_main_grad:
            persistent.main_grad.copy_(torch.full((3, 2), k + 1.0))
        else:
            persistent.main_grad.add_(torch.full((3, 2), k + 1.0))
    return {"persistent_flag": persistent.overwrite_main_grad, "fresh_flag": fresh.overwrite_main_grad,
            "persistent_sum": persistent._gbuf.data[0].item()}

def scenarios():
    return {"wgrad": wgrad_cases(), "flags_mcore": flag_cases(mcore_fsdp),
            "flags_standalone": flag_cases(standalone_fsdp), "moe": moe_case()}

R["patched"] = scenarios()
R["live"] = {"backward": type(vars(layers.LinearWithGradAccumulationAndAsyncCommunication)["backward"]).__name__,
             "unshard": type(vars(mcore_fsdp.MegatronFSDP)["all_gather_and_wait_parameters_ready"]).__name__}
gemm_patch.apply()  # again: a no-op for what is in place, and nothing else changes state
R["states_after_second_apply"] = states()
gemm_patch.revert()
R["reverted_originals"] = {
    "backward": vars(layers.LinearWithGradAccumulationAndAsyncCommunication)["backward"].__class__.__name__,
    "unshard": type(vars(mcore_fsdp.MegatronFSDP)["all_gather_and_wait_parameters_ready"]).__name__,
    "moe": type(vars(experts.TEGroupedMLP)["_ensure_main_grad"]).__name__}
R["unpatched"] = scenarios()

# Unknown code: left alone, forced with GEMM_PATCH_ALLOW_UNVERIFIED=1, refused in strict mode.
names = {t.name for t in MINE}
saved = p.targets()
p.use_targets(tuple(dataclasses.replace(t, fingerprints={}) if t.name in names else t for t in saved))
gemm_patch.apply()
R["unknown"] = {n: s for n, s in states().items() if n in names}
R["unknown_live"] = type(vars(layers.LinearWithGradAccumulationAndAsyncCommunication)["backward"]).__name__
gemm_patch.revert()
os.environ["GEMM_PATCH_ALLOW_UNVERIFIED"] = "1"
gemm_patch.apply()
R["forced"] = {n: s for n, s in states().items() if n in names}
R["forced_wgrad"] = wgrad_cases()
gemm_patch.revert()
os.environ["GEMM_PATCH_ALLOW_UNVERIFIED"] = "0"
try:
    gemm_patch.apply(strict=True)
    R["strict"] = "applied"
except gemm_patch.GemmPatchError as exc:
    R["strict"] = "refused: " + str(exc)
print("RESULT " + json.dumps(R))
'''


def run_driver(commit: str, driver: str, path: tuple[str, ...] = ()) -> dict:
    """``driver`` in a child interpreter with megatron-core and megatron-fsdp of ``commit`` (and
    ``path``) on its sys.path, gemm_patch's defaults (no GEMM_PATCH_* of this process); the JSON
    of its ``RESULT`` line. Skips where that commit's source cannot be had."""
    why = megatron_lm.prepare(commit)
    if why:
        pytest.skip(why)
    mcore, mfsdp = megatron_lm.folders(commit)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH")}
    env.update(PYTHONPATH=os.pathsep.join([str(mcore), str(mfsdp), str(ROOT), *path]), NO_VCS_VERSION="1",
               PYTHONWARNINGS="ignore", GEMM_PATCH_LOG_LEVEL="WARNING")
    out = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, env=env, timeout=600,
                         cwd=str(mcore))
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert out.returncode == 0 and line, out.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def main_run():
    return run_driver(COMMIT, DRIVER)


def test_main_reports_the_coming_releases_version(main_run):
    assert main_run["versions"]["megatron-core"] == "0.20.0"
    assert re.fullmatch(r"0\.7\.0rc0", main_run["versions"]["megatron-fsdp"])


def test_states_on_main(main_run):
    states = {name: state for name, (state, _) in main_run["states"].items()}
    for name in MAIN_TARGETS:
        assert states[name] == "compatible", main_run["states"][name]
        assert megatron_main.RELEASE in main_run["states"][name][1]
    # main's reduce code is 0.19.2's: the one-rank scale applies unchanged.
    for name in ("fsdp-one-rank-scale", "mfsdp-one-rank-scale"):
        assert states[name] == "compatible", main_run["states"][name]
    # The released forms of the same fixes find nothing to patch on main.
    assert states["fsdp-wgrad"] == "not applicable"
    assert states["fsdp-te-overwrite"] == "not applicable"
    assert states["mfsdp-te-overwrite"] == "not applicable"
    assert main_run["live"] == {"backward": "PatchedTwin", "unshard": "PatchedOverwriteFlag"}


# Without TE, main's own _wgrad_gemm lands the product in bf16 and copies it (PR #6624's
# fallback): within bf16's unit roundoff, 2**-8, of the exact product. The dispatcher's fp32
# products are within 1e-6.
BF16 = 2.0 ** -8


def test_persistent_buffer_sums_every_micro_batch(main_run):
    assert main_run["patched"]["wgrad"]["persistent_vs_sum"] < 1e-6
    # Without the target, main's _wgrad_gemm overwrites: only the last micro-batch is left.
    assert main_run["unpatched"]["wgrad"]["persistent_vs_last"] < BF16
    assert main_run["unpatched"]["wgrad"]["persistent_vs_sum"] > 0.3


def test_fresh_buckets_are_overwritten_by_megatrons_own_gemm(main_run):
    for run in ("patched", "unpatched"):
        wgrad = main_run[run]["wgrad"]
        assert wgrad["fresh_vs_each"] < BF16 and wgrad["fresh_persistent_untouched"] == 0, (run, wgrad)


def test_a_weight_used_twice_in_one_backward_sums_both_uses(main_run):
    assert main_run["patched"]["wgrad"]["twice_buckets"] == 1
    assert main_run["patched"]["wgrad"]["twice_vs_sum"] < BF16  # first use: megatron's own GEMM
    assert main_run["unpatched"]["wgrad"]["twice_vs_sum"] > 0.3, "upstream keeps only the second use"


@pytest.mark.parametrize("copy", ["flags_mcore", "flags_standalone"])
def test_by_strategy_flag_reset_where_the_buffer_persists(main_run, copy):
    patched, unpatched = main_run["patched"][copy], main_run["unpatched"][copy]
    # main: optim no longer overwrites; the sharded strategies still set True, also over a
    # persistent buffer (one data-parallel rank), which the target resets.
    for strategy in ("optim_grads", "optim_grads_params"):
        assert unpatched[f"{strategy}/persistent"] is True
        assert patched[f"{strategy}/persistent"] is False
        assert patched[f"{strategy}/fresh"] is True and patched[f"{strategy}/plain"] is True
    assert all(unpatched[f"optim/{kind}"] is False and patched[f"optim/{kind}"] is False
               for kind in ("persistent", "fresh", "plain"))


def test_moe_hook_on_main(main_run):
    assert main_run["patched"]["moe"] == {"persistent_flag": False, "fresh_flag": True, "persistent_sum": 6.0}
    assert main_run["unpatched"]["moe"]["persistent_flag"] is True
    assert main_run["unpatched"]["moe"]["persistent_sum"] == 3.0


def test_revert_puts_megatrons_objects_back(main_run):
    assert main_run["reverted_originals"] == {"backward": "staticmethod", "unshard": "function",
                                              "moe": "staticmethod"}


def test_unknown_code_left_alone_forced_on_request_refused_in_strict_mode(main_run):
    assert {n: s[0] for n, s in main_run["unknown"].items()} == dict.fromkeys(MAIN_TARGETS, "unverified")
    assert main_run["unknown_live"] == "staticmethod"
    assert {n: s[0] for n, s in main_run["forced"].items()} == dict.fromkeys(MAIN_TARGETS, "forced")
    assert main_run["forced_wgrad"]["persistent_vs_sum"] < 1e-6
    assert main_run["strict"].startswith("refused: ") and "GEMM_PATCH_STRICT=1" in main_run["strict"]


def test_second_apply_leaves_every_state_as_it_was(main_run):
    first = {n: s[0] for n, s in main_run["states"].items()}
    second = {n: s[0] for n, s in main_run["states_after_second_apply"].items()}
    assert second == first
