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

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_mcore_main_targets import ROOT, run_driver

sys.path.insert(0, str(ROOT / "compat"))
import megatron_lm  # noqa: E402  (compat/megatron_lm.py)

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


def reworded(path: Path, function: str) -> None:
    """``function``'s docstring in the file at ``path`` replaced by another, and a comment added:
    what a merge that rewords the explanation and nothing else does."""
    source = path.read_text()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == function)
    first = node.body[0]
    indent = " " * first.col_offset
    lines = source.splitlines(keepends=True)
    new = [f'{indent}"""Reworded when merged: the bucket of a one-rank group is scaled here."""\n',
           f"{indent}# a comment the merge added\n"]
    has_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
        and isinstance(first.value.value, str)
    start, end = (first.lineno - 1, first.end_lineno) if has_doc else (first.lineno - 1, first.lineno - 1)
    path.write_text("".join(lines[:start] + new + lines[end:]))


def test_the_fix_merged_with_other_docstrings_still_reads_fixed_upstream(tmp_path):
    """The merged form of the fix may differ from the recorded head in its docstrings and comments
    alone: gemm_patch still knows it as fixed upstream (by its code), installs nothing, and the
    gradient is scaled once, by megatron."""
    why = megatron_lm.prepare(PR_HEAD)
    if why:
        pytest.skip(why)
    folders = []
    for folder in megatron_lm.folders(PR_HEAD):
        copy = tmp_path / folder.name
        shutil.copytree(folder, copy)
        for path in copy.rglob("param_and_grad_buffer.py"):
            if "def gradient_reduce_preprocessing(" in path.read_text():
                reworded(path, "gradient_reduce_preprocessing")
        folders.append(copy)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH")}
    env.update(PYTHONPATH=os.pathsep.join([*map(str, folders), str(ROOT), str(ROOT / "tests" / "megatron")]),
               NO_VCS_VERSION="1", PYTHONWARNINGS="ignore", GEMM_PATCH_LOG_LEVEL="WARNING")
    out = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, env=env, timeout=600,
                         cwd=str(folders[0]))
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert out.returncode == 0 and line, out.stderr[-4000:]
    result = __import__("json").loads(line[len("RESULT "):])
    assert result["states"] == dict.fromkeys(NAMES, "not applicable"), result["states"]
    for name in NAMES:
        assert result["copies"][name]["installed"] == ["megatron"]
        for method in ("all_reduce_gradients", "reduce_scatter_gradients"):
            assert result["copies"][name][method] == {"exact": True, "ratio": 0.5}
