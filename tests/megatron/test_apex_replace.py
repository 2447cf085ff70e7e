"""GEMM_PATCH_APEX=replace against the real megatron-core release on PYTHONPATH, with apex's
extension present (simulated: a module that records its calls instead of running CUDA, as a real
apex that fails on the device would be): megatron's own layers must reach gemm_patch's stand-in,
not apex, and revert must give them apex back. The fake apex has to be importable before
megatron's layers module is: most cases run in a fresh interpreter; one imports the layers module
anew in this one, so that the version matrix runs it on every release."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest
from conftest import expected, torch
from megatron_cpu import build, model_parallel, step
from test_apex_wgrad import _FAKE_APEX, _PRELUDE, EXT, run_snippet

import gemm_patch
from gemm_patch.targets.apex_wgrad import STAND_IN, TARGET

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import contract  # noqa: E402

EXPECT_APEX = expected("apex-wgrad")
pytestmark = [pytest.mark.skipif(EXPECT_APEX not in ("verified", "compatible"),
                                reason=f"apex-wgrad is {EXPECT_APEX} on this release"),
              pytest.mark.proves("apex-wgrad")]

_RUN = """
import torch
from megatron_cpu import build, model_parallel, step
import megatron.core.tensor_parallel.layers as L
from gemm_patch.targets.apex_wgrad import STAND_IN, TARGET
EXT = "fused_weight_gradient_mlp_cuda"

def where():
    return (L.fused_weight_gradient_mlp_cuda is STAND_IN, sys.modules[EXT] is STAND_IN,
            L.fused_weight_gradient_mlp_cuda is fake, sys.modules[EXT] is fake, L._grad_accum_fusion_available)

def rel(layer, seed, dtype):
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=dtype)
    ref = step(layer, seed)
    return ((layer.weight.main_grad.double() - ref).norm() / ref.norm()).item()

st = {t.name: t for t in gemm_patch.status().targets}["apex-wgrad"]
print("STATE", st.state, gemm_patch.status().apex, st.reason)
with model_parallel():
    layer = build("column")
    row = build("row")
    print("PATCHED", *where())
    print("ERRORS", rel(layer, 1, torch.float32) < 1e-6, rel(row, 2, torch.float32) < 1e-6,
          rel(layer, 3, torch.bfloat16) < 2 ** -7)
    print("CALLS", len(calls))
    gemm_patch.revert()
    print("REVERTED", *where(), gemm_patch.status().apex)
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    step(layer, 4)
    print("CALLS", calls)
    gemm_patch.apply()
    print("REAPPLIED", *where(), gemm_patch.status().apex)
"""


def _lines(out) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        head, _, rest = line.partition(" ")
        found.setdefault(head, []).append(rest)
    return found


@pytest.mark.parametrize("order", ["gemm_patch_first", "megatron_first"])
def test_replace_routes_a_real_apex_through_gemm_patch_and_revert_gives_it_back(order):
    imports = "import gemm_patch\nimport megatron.core.tensor_parallel.layers\n"
    if order == "megatron_first":
        imports = "\n".join(reversed(imports.split("\n")))
    out = run_snippet(_PRELUDE + _FAKE_APEX + imports + _RUN, GEMM_PATCH_APEX="replace")
    got = _lines(out)
    state, word, reason = got["STATE"][0].split(" ", 2)
    assert (state, word) == (EXPECT_APEX, "replaced"), out.stdout
    assert reason.startswith("apex real, replaced: fused_weight_gradient_mlp_cuda."), reason
    # stand-in in the layers module and sys.modules, over the real one; the flag stays True
    assert got["PATCHED"] == ["True True False False True"], out.stdout
    # fp32 and bf16 main_grad through the dispatcher, Column and Row; apex never called
    assert got["ERRORS"] == ["True True True"], out.stdout
    assert got["CALLS"][0] == "0", out.stdout
    # revert: the real extension is back where it was and megatron's backward reaches it
    assert got["REVERTED"] == ["False False True True True off"], out.stdout
    assert got["CALLS"][1] == str([("fp32", [(36, 64), (36, 80), (80, 64)])]), out.stdout
    assert got["REAPPLIED"] == ["True True False False True replaced"], out.stdout


def recording_apex(calls: list) -> types.ModuleType:
    """A real apex, simulated in this process: megatron's import finds it, and each call is recorded."""
    fake = types.ModuleType(EXT)
    fake.wgrad_gemm_accum_fp32 = lambda *a: calls.append(("fp32", [tuple(t.shape) for t in a]))
    fake.wgrad_gemm_accum_fp16 = lambda *a: calls.append(("fp16", [tuple(t.shape) for t in a]))
    return fake


def test_replace_in_process_on_a_layers_module_imported_with_apex(monkeypatch):
    """In this interpreter, so on every release of the matrix: megatron's layers module imported
    anew while apex's extension is importable binds it; GEMM_PATCH_APEX=replace puts the stand-in
    over it there and in sys.modules, and revert gives it back."""
    name = TARGET.module
    package_name, _, short = name.rpartition(".")
    old, package = sys.modules[name], sys.modules[package_name]
    calls: list = []
    fake = recording_apex(calls)
    monkeypatch.setenv("GEMM_PATCH_APEX", "replace")
    gemm_patch.revert()
    try:
        sys.modules[EXT] = fake
        del sys.modules[name]
        fresh = importlib.import_module(name)
        assert fresh is not old and vars(fresh)[EXT] is fake
        gemm_patch.apply()

        st = contract.state_of(TARGET.name)
        assert (st.state, gemm_patch.status().apex) == (EXPECT_APEX, "replaced"), st.reason
        assert st.reason.startswith("apex real, replaced: fused_weight_gradient_mlp_cuda."), st.reason
        assert fresh.fused_weight_gradient_mlp_cuda is STAND_IN and sys.modules[EXT] is STAND_IN
        assert fresh._grad_accum_fusion_available is True

        with model_parallel():
            layer = build("column")
            assert type(layer).__module__ == name and isinstance(layer, fresh.ColumnParallelLinear)
            layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
            ref = step(layer, 1)
            rel = ((layer.weight.main_grad.double() - ref).norm() / ref.norm()).item()
            assert rel < 1e-6, rel
            assert calls == []

            gemm_patch.revert()
            assert fresh.fused_weight_gradient_mlp_cuda is fake and sys.modules[EXT] is fake
            assert gemm_patch.status().apex == "off"
            layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
            step(layer, 2)
            assert calls == [("fp32", [(36, 64), (36, 80), (80, 64)])]

            gemm_patch.apply()
            assert fresh.fused_weight_gradient_mlp_cuda is STAND_IN and sys.modules[EXT] is STAND_IN
            assert gemm_patch.status().apex == "replaced"
    finally:
        gemm_patch.revert()
        sys.modules[name] = old
        setattr(package, short, old)
        if sys.modules.get(EXT) is fake:
            del sys.modules[EXT]
        monkeypatch.undo()
        contract.forget(name, keep=old)
        gemm_patch.revert()
        gemm_patch.apply()


def test_default_still_leaves_a_real_apex_untouched():
    out = run_snippet(_PRELUDE + _FAKE_APEX + "import gemm_patch\n" + _RUN, GEMM_PATCH_APEX="1")
    got = _lines(out)
    assert got["STATE"][0].split()[:3] == ["apex", "real", "real"], out.stdout
    assert got["PATCHED"] == ["False False True True True"], out.stdout
    assert got["CALLS"][0] == "3", out.stdout


def test_summary_line_says_apex_was_replaced():
    out = run_snippet(_PRELUDE + _FAKE_APEX + "import gemm_patch, megatron.core.tensor_parallel.layers",
                      GEMM_PATCH_APEX="replace", GEMM_PATCH_LOG_LEVEL="INFO")
    summary = [line for line in out.stderr.splitlines() if "megatron-core" in line and "backends" in line]
    assert len(summary) == 1, out.stderr
    assert f"apex-wgrad replaced apex (GEMM_PATCH_APEX=replace; {EXPECT_APEX})" in summary[0], summary[0]


def test_a_bad_value_names_replace_and_patches_nothing():
    out = run_snippet(_PRELUDE + _FAKE_APEX + """
import gemm_patch, megatron.core.tensor_parallel.layers as L
print("RESULT", L.fused_weight_gradient_mlp_cuda is fake, gemm_patch.status().config_error)
""", GEMM_PATCH_APEX="sometimes")
    result = _lines(out)["RESULT"][0]
    assert result.startswith("True GEMM_PATCH_APEX='sometimes' is not accepted"), out.stdout
    assert result.endswith(", replace (unset means 1)"), result
