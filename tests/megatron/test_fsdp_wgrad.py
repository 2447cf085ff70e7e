"""The fsdp-wgrad target against the real megatron-core release on PYTHONPATH."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import threading

import pytest
from conftest import APPLICABLE, DTYPE_ERROR, EXPECT, layers, run_layer, torch
from megatron_cpu import unknown_release

import gemm_patch

pytestmark = pytest.mark.proves("fsdp-wgrad")

FUNCTION = layers.LinearWithGradAccumulationAndAsyncCommunication
needs_call_site = pytest.mark.skipif(not APPLICABLE, reason="release has no such call site")


def target_state():
    return {t.name: t for t in gemm_patch.status().targets}["fsdp-wgrad"]


def test_state_is_what_the_matrix_expects(patched):
    st = target_state()
    assert st.state == EXPECT, st.reason
    assert st.version is not None


@needs_call_site
def test_unpatched_crashes_with_the_dtype_error(unpatched):
    with pytest.raises(RuntimeError, match=DTYPE_ERROR):
        run_layer(torch.float32)


@needs_call_site
def test_patched_fp32_main_grad_matches_fp64_and_is_fully_written(patched):
    out = run_layer(torch.float32)
    main_grad = out["main_grad"]
    assert main_grad.dtype == torch.float32
    assert not torch.isnan(main_grad).any(), "main_grad not fully written"
    rel = ((main_grad.double() - out["reference"]).norm() / out["reference"].norm()).item()
    assert rel < 1e-6, rel


@needs_call_site
def test_forward_and_dgrad_bitwise_equal_to_unpatched():
    gemm_patch.revert()
    ref = run_layer(torch.bfloat16)
    gemm_patch.apply()
    for main_dtype in (torch.bfloat16, torch.float32):
        got = run_layer(main_dtype)
        assert torch.equal(got["y"], ref["y"])
        assert torch.equal(got["dgrad"], ref["dgrad"])


@needs_call_site
def test_bf16_main_grad_bitwise_equal_to_unpatched():
    gemm_patch.revert()
    ref = run_layer(torch.bfloat16)["main_grad"]
    gemm_patch.apply()
    got = run_layer(torch.bfloat16)["main_grad"]
    assert torch.equal(got, ref)


def test_revert_restores_the_original_object_and_the_crash():
    gemm_patch.revert()
    original = vars(FUNCTION)["backward"]
    gemm_patch.apply()
    patched_obj = vars(FUNCTION)["backward"]
    if APPLICABLE:
        assert patched_obj is not original
        assert patched_obj.__wrapped__ is original
    else:
        assert patched_obj is original
    gemm_patch.revert()
    assert vars(FUNCTION)["backward"] is original
    if APPLICABLE:
        with pytest.raises(RuntimeError, match=DTYPE_ERROR):
            run_layer(torch.float32)
    gemm_patch.apply()


def test_apply_twice_is_a_no_op(patched):
    first = vars(FUNCTION)["backward"]
    gemm_patch.apply()
    assert vars(FUNCTION)["backward"] is first


def test_module_namespace_is_untouched():
    gemm_patch.revert()
    before = dict(vars(layers))
    gemm_patch.apply()
    after = dict(vars(layers))
    # Only the apex-wgrad target writes here, and only when it provides apex's extension
    # (tests/megatron/test_apex_wgrad.py checks those two names and their revert).
    apex_names = {"fused_weight_gradient_mlp_cuda", "_grad_accum_fusion_available"}
    assert after.keys() - apex_names == before.keys() - apex_names
    changed = [k for k in before if k not in apex_names and after[k] is not before[k]]
    assert changed == []
    others = {k: v for k, v in vars(FUNCTION).items() if k != "backward"}
    gemm_patch.revert()
    assert {k: v for k, v in vars(FUNCTION).items() if k != "backward"} == others
    gemm_patch.apply()


def test_concurrent_apply_and_revert_leave_a_consistent_state():
    gemm_patch.revert()
    original = vars(FUNCTION)["backward"]
    barrier = threading.Barrier(8)

    def worker(i):
        barrier.wait()
        for _ in range(20):
            (gemm_patch.apply if i % 2 else gemm_patch.revert)()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gemm_patch.revert()
    assert vars(FUNCTION)["backward"] is original
    gemm_patch.apply()
    current = vars(FUNCTION)["backward"]
    assert (current.__wrapped__ is original) if APPLICABLE else (current is original)


@needs_call_site
@pytest.mark.common_machinery
@pytest.mark.parametrize("order", ["gemm_patch_first", "megatron_first"])
def test_import_order_does_not_matter(order):
    imports = ["import gemm_patch", "import megatron.core.tensor_parallel.layers as L"]
    if order == "megatron_first":
        imports.reverse()
    code = "; ".join(imports + [
        "import sys",
        "st = {t.name: t.state for t in gemm_patch.status().targets}",
        "print(st['fsdp-wgrad'], 'torch' in sys.modules)",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [EXPECT, "True"], out.stderr


def test_import_gemm_patch_alone_imports_no_framework():
    code = ("import sys, gemm_patch; "
            "print(sorted(m for m in ('torch', 'megatron', 'transformer_engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


_UNKNOWN_RELEASE = unknown_release("fsdp-wgrad") + """
import gemm_patch, torch
try:
    import megatron.core.tensor_parallel.layers as L
except gemm_patch.GemmPatchError as exc:
    print("refused:", exc)
print(gemm_patch.status().targets[0].state)
"""


@needs_call_site
@pytest.mark.parametrize("mode", [pytest.param("default", marks=pytest.mark.common_machinery),
                                  pytest.param("strict", marks=pytest.mark.common_machinery), "allow"])
def test_unknown_code_is_left_alone_unless_allowed_and_refused_in_strict_mode(mode):
    env = {**os.environ, "GEMM_PATCH_STRICT": "1" if mode == "strict" else "0",
           "GEMM_PATCH_ALLOW_UNVERIFIED": "1" if mode == "allow" else "0"}
    out = subprocess.run([sys.executable, "-c", _UNKNOWN_RELEASE], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    state = out.stdout.split()[-1]
    if mode == "strict":
        assert "refused: fsdp-wgrad:" in out.stdout and "not a verified release" in out.stdout, out.stdout
        assert state != "unverified"
    elif mode == "default":
        assert state == "unverified", out.stdout
        warnings = [line for line in out.stderr.splitlines() if "fsdp-wgrad unverified" in line]
        assert len(warnings) == 1 and warnings[0].startswith("[gemm_patch] WARNING:"), out.stderr
        assert "GEMM_PATCH_ALLOW_UNVERIFIED=1" in warnings[0] and "fingerprint" in warnings[0]
    else:
        assert state == "forced", out.stdout


@needs_call_site
def test_unknown_code_stays_megatrons_own():
    """Left alone means left alone: the class keeps megatron's own backward, and the fp32
    main_grad crash is megatron's own."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = _UNKNOWN_RELEASE + (
        f"import sys; sys.path.insert(0, {here!r})\n"
        "from conftest import run_layer, DTYPE_ERROR\n"
        "print(type(vars(L.LinearWithGradAccumulationAndAsyncCommunication)['backward']).__name__)\n"
        "try:\n    run_layer(torch.float32)\nexcept RuntimeError as exc:\n    print('crash', DTYPE_ERROR in str(exc))\n"
    )
    # The gate closed as a user has it (an adoption run opens it for the release under test).
    env = {**os.environ, "GEMM_PATCH_ALLOW_UNVERIFIED": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-4:] == ["unverified", "staticmethod", "crash", "True"], out.stdout


@needs_call_site
def test_upstream_te_call_is_redirected_only_where_the_release_has_it(patched):
    import inspect

    twin = vars(FUNCTION)["backward"]._self_gemm_patch_twin
    raw = inspect.unwrap(twin.__func__ if isinstance(twin, staticmethod) else twin)
    has_te_call = "te_general_gemm(" in inspect.getsource(vars(FUNCTION)["backward"].__wrapped__.__func__)
    assert ("_gemm_patch_also_0" in raw.__code__.co_freevars) == has_te_call
    assert "_gemm_patch_wgrad" in raw.__code__.co_freevars


def test_te_branch_stand_in_accumulates_into_a_persistent_buffer():
    """fsdp_wgrad_te, which 0.18+'s TE call goes to, on a parameter whose Megatron-FSDP
    buffer persists (``_gbuf.is_data_distributed`` False): adds, never overwrites. (The fresh-
    buffer case calls megatron's own te_general_gemm, which needs TE: tests/gpu.)"""
    from types import SimpleNamespace

    from gemm_patch.targets.fsdp_wgrad import fsdp_wgrad_te

    gen = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.zeros(24, 16, dtype=torch.bfloat16))
    weight._gbuf = SimpleNamespace(is_data_distributed=False)
    main_grad = torch.zeros(24, 16)
    expected = torch.zeros(24, 16, dtype=torch.float64)
    for _ in range(3):
        total_input = torch.randn(40, 16, generator=gen).to(torch.bfloat16)
        grad_output = torch.randn(40, 24, generator=gen).to(torch.bfloat16)
        fsdp_wgrad_te(total_input, grad_output, out_dtype=torch.float32, layout="NT", out=main_grad,
                                 grad=True, param=weight)
        expected += grad_output.double().t() @ total_input.double()
    assert ((main_grad.double() - expected).norm() / expected.norm()).item() < 1e-6


@needs_call_site
def test_a_style_only_edit_that_keeps_the_bug_is_unverified(tmp_path):
    """``weight.main_grad`` bound to a local name before the same call: the same dtype error and
    overwrite, but no literal match. Unknown code reads unverified with its warning (0.3.0 read
    it as not applicable, with no warning, and left the bug in place)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from source_modules import load_edited_copy

    from gemm_patch.engine import config, detection
    from gemm_patch.targets.fsdp_wgrad import CALL, TARGET

    line = next(line for line in inspect.getsource(layers).splitlines(keepends=True) if line.strip() == CALL)
    indent = line[:len(line) - len(line.lstrip())]
    through_local = CALL.replace("out=weight.main_grad", "out=main_grad")
    edited = load_edited_copy(tmp_path, layers, line,
                              f"{indent}main_grad = weight.main_grad\n{indent}{through_local}\n")
    try:
        version = detection.distribution_version("megatron-core")
        st, undo = TARGET.patch(edited, version, config.Config())
        assert st.state == "unverified" and "another form" in st.reason, st.reason
        assert not undo.steps
        with pytest.raises(Exception, match="GEMM_PATCH_STRICT"):
            TARGET.patch(edited, version, config.Config(strict=True))
    finally:
        sys.modules.pop(edited.__name__, None)
