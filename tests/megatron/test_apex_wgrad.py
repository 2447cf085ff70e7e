"""The apex-wgrad target (gemm_patch's stand-in for apex's ``fused_weight_gradient_mlp_cuda``)
against the real megatron-core release on PYTHONPATH, whose layers are built and trained through
their own constructors and autograd functions (compat/matrix.py passes the expected state of each target)."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import expected, layers, torch
from megatron_cpu import FUSION_MESSAGE, build, config, model_parallel, step, unknown_release

import gemm_patch
from gemm_patch.targets.apex_wgrad import STAND_IN, is_stand_in

pytestmark = pytest.mark.proves("apex-wgrad")

EXPECT_APEX = expected("apex-wgrad")
PROVIDED = EXPECT_APEX in ("verified", "compatible", "forced")
EXT = "fused_weight_gradient_mlp_cuda"
FLAG = "_grad_accum_fusion_available"
HERE = Path(__file__).resolve().parent
needs_stand_in = pytest.mark.skipif(not PROVIDED, reason=f"apex-wgrad is {EXPECT_APEX} on this release")


def apex_target():
    return {t.name: t for t in gemm_patch.status().targets}["apex-wgrad"]


@pytest.fixture(scope="module", autouse=True)
def no_real_apex():
    if EXT in sys.modules and not is_stand_in(sys.modules[EXT]):
        pytest.skip("a real apex is importable here; these tests are about its absence")


@pytest.fixture(scope="module")
def mp():
    with model_parallel():
        yield


@pytest.fixture
def patched():
    gemm_patch.apply()
    yield


@pytest.fixture
def apex_off(monkeypatch):
    monkeypatch.setenv("GEMM_PATCH_APEX", "0")
    gemm_patch.revert()
    gemm_patch.apply()
    yield
    monkeypatch.delenv("GEMM_PATCH_APEX")
    gemm_patch.revert()
    gemm_patch.apply()


def test_state_is_what_the_matrix_expects(patched):
    st = apex_target()
    assert st.state == EXPECT_APEX, st.reason
    status = gemm_patch.status()
    assert status.apex == ("provided" if PROVIDED else "missing")
    assert status.as_dict()["apex"] == status.apex
    assert f"apex: {status.apex}: " in str(status)


def test_status_json_only_gains_fields(patched):
    st = gemm_patch.status().as_dict()
    assert {"schema", "gemm_patch", "applied", "strict", "backend", "config_error", "versions",
            "targets", "backends"} < st.keys()
    assert st["schema"] == 1
    # 0.1.0's targets keep their order at the front; later ones are only appended.
    assert [t["name"] for t in st["targets"]][:4] == ["fsdp-wgrad", "apex-wgrad", "fsdp-te-overwrite",
                                                      "mfsdp-te-overwrite"]
    assert all(t.keys() == {"name", "module", "state", "reason", "version", "fingerprint"}
               for t in st["targets"])


@needs_stand_in
@pytest.mark.parametrize("kind", ["column", "row"])
def test_layers_build_with_fusion_on_without_apex(mp, patched, kind):
    layer = build(kind)
    assert layer.gradient_accumulation_fusion is True
    assert layers.fused_weight_gradient_mlp_cuda is STAND_IN
    assert importlib.import_module(EXT) is STAND_IN  # the by-name import in megatron/core/utils.py


@needs_stand_in
def test_fusion_off_layers_are_unaffected(mp, patched):
    assert build("column", fusion=False).gradient_accumulation_fusion is False


def test_construction_fails_with_megatrons_message_when_switched_off(mp, apex_off):
    st = apex_target()
    assert st.state == "off", st.reason
    assert "GEMM_PATCH_APEX=0" in st.reason
    assert gemm_patch.status().apex == "off"
    assert EXT not in sys.modules and EXT not in vars(layers)
    with pytest.raises(RuntimeError, match=FUSION_MESSAGE):
        build("column")
    with pytest.raises(ImportError):
        importlib.import_module(EXT)


def test_revert_restores_everything_exactly(mp):
    gemm_patch.revert()
    before = dict(vars(layers))
    assert EXT not in sys.modules and before[FLAG] is False
    gemm_patch.apply()
    after = dict(vars(layers))
    changed = {k for k in after.keys() | before.keys() if after.get(k, None) is not before.get(k, None)}
    if PROVIDED:
        assert changed == {EXT, FLAG}
        assert after[EXT] is STAND_IN and after[FLAG] is True and sys.modules[EXT] is STAND_IN
    else:
        assert changed == set()
    gemm_patch.revert()
    restored = dict(vars(layers))
    assert restored.keys() == before.keys()
    assert all(restored[k] is before[k] for k in before)
    assert EXT not in sys.modules
    assert apex_target().state == "off" and gemm_patch.status().apex == "off"
    with pytest.raises(RuntimeError, match=FUSION_MESSAGE):
        build("column")
    with pytest.raises(ImportError):
        importlib.import_module(EXT)
    gemm_patch.apply()


def test_revert_leaves_a_module_imported_since_in_place(mp, patched):
    foreign = type(sys)(EXT)
    if PROVIDED:
        sys.modules[EXT] = foreign  # e.g. apex installed and imported after the patch
    gemm_patch.revert()
    try:
        assert sys.modules.get(EXT) is (foreign if PROVIDED else None)
    finally:
        sys.modules.pop(EXT, None)
        gemm_patch.apply()


def test_apply_twice_is_a_no_op(patched):
    first = (vars(layers).get(EXT), sys.modules.get(EXT), vars(layers)[FLAG])
    gemm_patch.apply()
    assert (vars(layers).get(EXT), sys.modules.get(EXT), vars(layers)[FLAG]) == first


@needs_stand_in
@pytest.mark.parametrize("kind", ["column", "row"])
def test_fp32_main_grad_accumulates_two_passes_to_the_fp64_sum(mp, patched, kind):
    layer = build(kind)
    gen = torch.Generator().manual_seed(7)
    start = torch.randn(layer.weight.shape, generator=gen)  # accumulate onto what is there
    layer.weight.main_grad = start.clone()
    expected = start.double()
    for seed in (1, 2):
        expected += step(layer, seed)
    main_grad = layer.weight.main_grad
    assert main_grad.dtype == torch.float32
    assert layer.weight.grad is None  # the gradient went into main_grad only
    rel = ((main_grad.double() - expected).norm() / expected.norm()).item()
    assert rel < 1e-6, rel


@needs_stand_in
def test_bf16_main_grad_accumulates_in_bf16(mp, patched):
    layer = build("column")
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.bfloat16)
    expected = layer.weight.main_grad.clone()
    exact = torch.zeros(layer.weight.shape, dtype=torch.float64)
    for seed in (1, 2):
        wgrad = step(layer, seed)
        expected = (expected.double() + wgrad).to(torch.bfloat16)  # rounded once per pass, as apex
        exact += wgrad
    got = layer.weight.main_grad
    assert got.dtype == torch.bfloat16
    # fp32 accumulation inside each pass, one bf16 rounding per pass: within a bf16 ulp of the
    # per-pass rounded fp64 value (the fp32 vs fp64 inner sum can flip a rounding at a tie).
    torch.testing.assert_close(got.double(), expected.double(), rtol=2 ** -8, atol=1e-3)
    rel = ((got.double() - exact).norm() / exact.norm()).item()
    assert 0 < rel < 2 ** -7, rel


@needs_stand_in
def test_deferred_embedding_wgrad_imports_the_stand_in_by_name(mp, patched):
    from megatron.core import parallel_state, utils

    weight = torch.nn.Parameter(torch.zeros(40, 24, dtype=torch.bfloat16))
    weight.main_grad = torch.zeros(40, 24)
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(16, 24, generator=gen).to(torch.bfloat16) for _ in range(3)]
    grads = [torch.randn(16, 40, generator=gen).to(torch.bfloat16) for _ in range(3)]
    expected = sum(g.double().t() @ x.double() for g, x in zip(grads, inputs, strict=True))
    args = [config(), list(inputs), list(grads), weight]
    if "tp_group" in inspect.signature(utils.drain_embedding_wgrad_compute).parameters:
        args.append(parallel_state.get_tensor_model_parallel_group())
    utils.drain_embedding_wgrad_compute(*args)
    rel = ((weight.main_grad.double() - expected).norm() / expected.norm()).item()
    assert rel < 1e-6, rel


# -- in a fresh interpreter -----------------------------------------------------------------------

_PRELUDE = f"""
import sys, types
sys.path.insert(0, {str(HERE)!r})
"""

# A real apex, simulated: a module that megatron's `import fused_weight_gradient_mlp_cuda` finds
# and that records each call instead of running CUDA.
_FAKE_APEX = """
calls = []
fake = types.ModuleType("fused_weight_gradient_mlp_cuda")
fake.wgrad_gemm_accum_fp32 = lambda *a: calls.append(("fp32", [tuple(t.shape) for t in a]))
fake.wgrad_gemm_accum_fp16 = lambda *a: calls.append(("fp16", [tuple(t.shape) for t in a]))
sys.modules["fused_weight_gradient_mlp_cuda"] = fake
"""

_REAL_APEX_RUN = """
import torch
from megatron_cpu import build, model_parallel, step
import megatron.core.tensor_parallel.layers as L
st = {t.name: t for t in gemm_patch.status().targets}["apex-wgrad"]
with model_parallel():
    layer = build("column")
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    step(layer, 1)
    gemm_patch.revert(); gemm_patch.apply(); gemm_patch.revert(); gemm_patch.apply()
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.bfloat16)
    step(layer, 2)
print(st.state, gemm_patch.status().apex, L.fused_weight_gradient_mlp_cuda is fake,
      sys.modules["fused_weight_gradient_mlp_cuda"] is fake, L._grad_accum_fusion_available)
print(calls)
"""


def run_snippet(code: str, **env: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.mark.parametrize("order", ["gemm_patch_first", "megatron_first"])
def test_real_apex_is_used_untouched(order):
    imports = "import gemm_patch\nimport megatron.core.tensor_parallel.layers\n"
    if order == "megatron_first":
        imports = "\n".join(reversed(imports.split("\n")))
    out = run_snippet(_PRELUDE + _FAKE_APEX + imports + _REAL_APEX_RUN)
    first, second = out.stdout.strip().splitlines()[-2:]
    assert first.split() == ["apex", "real", "real", "True", "True", "True"], out.stdout
    # megatron's own calls reached the real extension: (total_input, grad_output, main_grad)
    assert second == str([("fp32", [(36, 64), (36, 80), (80, 64)]),
                          ("fp16", [(36, 64), (36, 80), (80, 64)])]), out.stdout


def test_apex_imported_after_megatron_is_not_shadowed():
    code = _PRELUDE + """
import megatron.core.tensor_parallel.layers as L
""" + _FAKE_APEX + """
import gemm_patch
st = {t.name: t for t in gemm_patch.status().targets}["apex-wgrad"]
print(st.state, "fused_weight_gradient_mlp_cuda" in vars(L), sys.modules["fused_weight_gradient_mlp_cuda"] is fake)
"""
    out = run_snippet(code)
    assert out.stdout.split()[-3:] == ["skipped", "False", "True"], out.stdout


@pytest.mark.parametrize("apex", ["1", "0"])
def test_summary_line_says_what_happened_to_apex(apex):
    # DEBUG: where nothing of the module is patched (0.13 with GEMM_PATCH_APEX=0) the line is DEBUG.
    out = run_snippet("import gemm_patch, megatron.core.tensor_parallel.layers",
                      GEMM_PATCH_APEX=apex, GEMM_PATCH_LOG_LEVEL="DEBUG")
    summary = [line for line in out.stderr.splitlines() if "megatron-core" in line and "apex-wgrad" in line]
    assert len(summary) == 1, out.stderr
    expected = ("apex-wgrad provided (apex missing; " if PROVIDED else "apex-wgrad ") if apex == "1" \
        else "apex-wgrad off (GEMM_PATCH_APEX=0)"
    assert expected in summary[0], summary[0]


_UNKNOWN_RELEASE = unknown_release("apex-wgrad") + """
import gemm_patch
for attempt in range(2):  # strict mode refuses every import, not only the first
    try:
        import megatron.core.tensor_parallel.layers as L
        print(gemm_patch.status().targets[1].state, L._grad_accum_fusion_available)
        break
    except gemm_patch.GemmPatchError as exc:
        print("refused:", exc)
"""


@needs_stand_in
@pytest.mark.parametrize("mode", ["default", "strict", "allow"])
def test_unknown_apex_usage_is_not_provided_unless_allowed_and_refused_in_strict_mode(mode):
    out = run_snippet(_UNKNOWN_RELEASE, GEMM_PATCH_STRICT="1" if mode == "strict" else "0",
                      GEMM_PATCH_ALLOW_UNVERIFIED="1" if mode == "allow" else "0")
    if mode == "strict":
        assert out.stdout.count("refused: apex-wgrad:") == 2 and "not a verified release" in out.stdout, out.stdout
        assert "megatron.core.tensor_parallel.layers" not in out.stdout.splitlines()[-1]
    elif mode == "default":
        assert out.stdout.split()[-2:] == ["unverified", "False"], out.stdout
        assert sum("apex-wgrad unverified" in line for line in out.stderr.splitlines()) == 1, out.stderr
    else:
        assert out.stdout.split()[-2:] == ["forced", "True"], out.stdout


@needs_stand_in
@pytest.mark.parametrize("kind", ["column", "row"])
def test_revert_says_which_layers_built_under_the_stand_in_cannot_run_without_it(mp, patched, kind, caplog):
    """A layer built with fusion on while gemm_patch stood in for apex (megatron would not have
    built it) cannot run its backward once ``revert()`` takes the stand-in out: revert and status
    say so, and how to go on; ``apply()`` again before the backward finishes the step a forward
    recorded, exactly."""
    layer = build(kind)
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
    x = torch.randn(12, 3, layer.input_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = layer(x.requires_grad_())[0]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    try:
        gemm_patch.revert()
        said = [r.getMessage() for r in caplog.records if "apex-wgrad: taken out" in r.getMessage()]
        assert len(said) == 1 and f"1 {type(layer).__name__} built under it cannot run without it" in said[0], said
        assert "NameError" in said[0] and "apply() again" in said[0]
        st = apex_target()
        assert st.state == "off" and "cannot run without it" in st.reason, st.reason
        with pytest.raises(NameError, match=EXT):
            out.backward(grad_out, retain_graph=True)  # what the words say: megatron's own backward
        gemm_patch.apply()
        out.backward(grad_out)
        go = grad_out.reshape(-1, grad_out.shape[-1]).double()
        exact = go.t() @ x.detach().reshape(-1, x.shape[-1]).double()
        assert (layer.weight.main_grad.double() - exact).norm() / exact.norm() < 1e-2
        assert "cannot run" not in apex_target().reason
    finally:
        gemm_patch.apply()
    del layer, out
    gemm_patch.revert()  # none left: nothing said, status as before
    assert "cannot run" not in apex_target().reason
    gemm_patch.apply()
