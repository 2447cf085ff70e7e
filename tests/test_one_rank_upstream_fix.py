"""The one-rank scale on Megatron-LM PR #6773's code, where megatron scales a one-rank group's
bucket itself, against main at the pinned commit, where gemm_patch does.

On the PR's head, ``gradient_reduce_preprocessing`` takes the group's size from its callers and,
for a one-rank group, multiplies the bucket by the factor and reduces with SUM (its PreMulSum
branch stays for larger groups). fsdp-one-rank-scale and mfsdp-one-rank-scale fingerprint that
function: the PR changes it, and its fingerprint is recorded as fixed upstream
(``Target.fixed_upstream``), so both read "not applicable" there and install nothing. The
gradient must then be scaled exactly once, by megatron. On main (the fingerprint recorded) gemm_patch
scales it, once as well.

Each commit's megatron-core and megatron-fsdp are unpacked as tests/test_mcore_main_targets.py
unpacks main's (compat/megatron_lm.py; skipped where the source cannot be had), and one child
interpreter per commit runs gemm_patch with its defaults and tests/megatron/test_one_rank_scale.py's
one-rank reduce through megatron's own ``ParamAndGradBuffer`` callers, on both copies.
"""

from __future__ import annotations

import pytest
from test_mcore_main_targets import ROOT, run_driver

from gemm_patch.targets import one_rank_scale
from gemm_patch.upstream import megatron_main

PR_HEAD = "c00aacff0573c5d286511249bcb27517211c0eff"  # Megatron-LM PR #6773's head
NAMES = (one_rank_scale.TARGET.name, one_rank_scale.STANDALONE.name)

DRIVER = r'''
import json, tempfile
import torch.distributed as dist
import gemm_patch
from gemm_patch.targets import one_rank_scale

gemm_patch.apply()
import megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp  # settles the targets
import megatron_fsdp.megatron_fsdp
import test_one_rank_scale as case  # tests/megatron: the buffers and the reduce

store = tempfile.TemporaryDirectory()
dist.init_process_group("gloo", init_method=f"file://{store.name}/store", rank=0, world_size=1)
MINE = (one_rank_scale.TARGET, one_rank_scale.STANDALONE)
R = {"states": {t.name: t.state for t in gemm_patch.status().targets if t.name in {m.name for m in MINE}},
     "copies": {}}
for target in MINE:
    module = target._pgb()
    live = (vars(module)["gradient_reduce_preprocessing"], vars(module.DataParallelBuffer)["__init__"],
            vars(module.ParamAndGradBuffer)["update_main_grads"])
    copy = R["copies"][target.name] = {
        "installed": sorted({getattr(f, "_self_gemm_patch_target", None) or "megatron" for f in live})}
    for method in case.REDUCERS:
        got, expected = case.reduce_through_megatron(method, module)
        copy[method] = {"exact": bool((got == expected).all()), "ratio": (got / (expected / case.FACTOR)).mean().item()}
print("RESULT " + json.dumps(R))
'''


def one_rank_run(commit: str) -> dict:
    return run_driver(commit, DRIVER, (str(ROOT / "tests" / "megatron"),))


@pytest.fixture(scope="module")
def pr_run():
    return one_rank_run(PR_HEAD)


@pytest.fixture(scope="module")
def main_run():
    return one_rank_run(megatron_main.COMMIT)


def test_pr_head_scales_once_and_gemm_patch_stays_out(pr_run):
    assert pr_run["states"] == dict.fromkeys(NAMES, "not applicable")
    for name in NAMES:
        copy = pr_run["copies"][name]
        assert copy["installed"] == ["megatron"], (name, copy)
        for method in ("all_reduce_gradients", "reduce_scatter_gradients"):
            assert copy[method] == {"exact": True, "ratio": 0.5}, (name, method, copy[method])


def test_main_scales_once_through_gemm_patch(main_run):
    assert main_run["states"] == dict.fromkeys(NAMES, "compatible")
    for name in NAMES:
        copy = main_run["copies"][name]
        assert copy["installed"] == [name], (name, copy)
        for method in ("all_reduce_gradients", "reduce_scatter_gradients"):
            assert copy[method] == {"exact": True, "ratio": 0.5}, (name, method, copy[method])
