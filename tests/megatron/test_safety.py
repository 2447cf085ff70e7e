"""A patch that rewrites how gradients are written must be safe in every case it does not know.
Each test here reproduces a way gemm_patch 0.1.0 went wrong on a real megatron-core release,
in a fresh interpreter: edited code, a replaced function, a reload, a half-imported module, a
second import under strict mode, a wrapper installed on top, a mis-shaped main_grad."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import APPLICABLE, layers

# The gate's default and strict modes, threads, reloads: the same machinery on every release.
pytestmark = [pytest.mark.proves("fsdp-wgrad"), pytest.mark.common_machinery]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
needs_call_site = pytest.mark.skipif(not APPLICABLE, reason="this release has no Megatron-FSDP wgrad call site")

CALL = "torch.matmul(grad_output.t(), total_input, out=weight.main_grad)"

# 4 micro-batches through megatron's own backward into a persistent (``_gbuf`` not distributed)
# bf16 main_grad; prints main_grad's norm over the fp64 sum's.
MICRO_BATCHES = """
import torch, types, megatron.core.tensor_parallel.layers as L
gen = torch.Generator().manual_seed(0)
weight = torch.nn.Parameter(torch.randn(80, 64, generator=gen).to(torch.bfloat16))
buffer = torch.zeros(80, 64, dtype=torch.bfloat16)
weight.__fsdp_param__ = True
weight.main_grad = buffer
weight.get_main_grad = lambda: buffer
weight._gbuf = types.SimpleNamespace(is_data_distributed=False)
total = torch.zeros(80, 64, dtype=torch.float64)
for _ in range(4):
    x = torch.randn(96, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    y = L.linear_with_grad_accumulation_and_async_allreduce(
        x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False)
    g = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
    y.backward(g)
    total += g.double().t() @ x.detach().double()
print("ratio", round((buffer.double().norm() / total.norm()).item(), 3))
"""


def snippet(*parts: str) -> str:
    return "".join(textwrap.dedent(part) for part in parts)


def run(code: str, pythonpath: list[str] | None = None, **env: str) -> subprocess.CompletedProcess:
    path = [*(pythonpath or []), str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=300)


def states(out: subprocess.CompletedProcess) -> dict[str, str]:
    line = next(line for line in out.stdout.splitlines() if line.startswith("states "))
    return dict(item.split("=", 1) for item in line.split()[1:])


PRINT_STATES = ("import gemm_patch\n"
                "print('states', ' '.join(f\"{t.name}={t.state.replace(' ', '_')}\" "
                "for t in gemm_patch.status().targets))\n")


@pytest.fixture(scope="module")
def edited_release(tmp_path_factory) -> Path:
    """This release with its FSDP branch changed the way an upstream fix of the overwrite bug
    might: the buffer's earlier content added back around the very same call."""
    source = Path(layers.__file__).resolve().parents[2]  # .../megatron
    target = tmp_path_factory.mktemp("edited") / "megatron"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    path = target / "core" / "tensor_parallel" / "layers.py"
    lines = path.read_text().splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() == CALL:
            pad = line[: len(line) - len(line.lstrip())]
            lines[i] = (f"{pad}_earlier = weight.main_grad.clone()\n{line}"
                        f"{pad}weight.main_grad.add_(_earlier)\n")
            break
    else:
        pytest.skip("no call site to edit")
    path.write_text("".join(lines))
    return target.parent


@needs_call_site
def test_edited_code_is_left_alone_and_keeps_its_own_semantics(edited_release):
    """0.1.0 patched it as 'unverified' with one warning, and the main_grad after 4 micro-batches
    was 4.58x the true sum (its accumulate plus the edit's add-back)."""
    # The gate closed as a user has it (an adoption run opens it for the release under test).
    out = run("import gemm_patch\n" + MICRO_BATCHES + PRINT_STATES, [str(edited_release)],
              GEMM_PATCH_ALLOW_UNVERIFIED="0")
    assert out.returncode == 0, out.stderr
    assert states(out)["fsdp-wgrad"] == "unverified", out.stdout
    ratio = float(next(line for line in out.stdout.splitlines() if line.startswith("ratio")).split()[1])
    assert abs(ratio - 1.0) < 0.02, out.stdout  # the edited code's own sum, not gemm_patch's on top
    warning = [line for line in out.stderr.splitlines() if "fsdp-wgrad unverified" in line]
    assert len(warning) == 1 and "GEMM_PATCH_ALLOW_UNVERIFIED=1" in warning[0], out.stderr
    assert "fingerprint" in warning[0] and "differs from the recorded" in warning[0], warning[0]


@needs_call_site
def test_a_function_replaced_by_other_code_is_left_alone():
    """0.1.0 built its twin from the file and installed it over the replacement (status said
    verified); the replacement was silently never called again."""
    out = run(snippet("""
        import os
        os.environ["GEMM_PATCH"] = "0"
        import gemm_patch, megatron.core.tensor_parallel.layers as L
        F = L.LinearWithGradAccumulationAndAsyncCommunication
        original = F.backward
        calls = []
        def backward(ctx, grad_output):
            calls.append(1)
            return original(ctx, grad_output)
        F.backward = staticmethod(backward)
        os.environ["GEMM_PATCH"] = "1"
        gemm_patch.apply()
        st = gemm_patch.status().targets[0]
        print("state", st.state, vars(F)["backward"].__func__ is backward)
        print("reason", st.reason)
    """))
    assert out.returncode == 0, out.stderr
    assert "state skipped True" in out.stdout, out.stdout
    assert "is not megatron's own function" in out.stdout, out.stdout


@needs_call_site
def test_reload_is_patched_again_and_status_describes_the_live_class():
    """0.1.0: after importlib.reload status still said verified, apply() did nothing and the
    fp32 backward crashed again (or, bf16 on a persistent buffer, kept 0.504 of the gradient)."""
    out = run(snippet("""
        import importlib, torch
        import gemm_patch, megatron.core.tensor_parallel.layers as L
        importlib.reload(L)
        gemm_patch.apply()
        from conftest import run_layer
        r = run_layer(torch.float32)
        err = ((r["main_grad"].double() - r["reference"]).norm() / r["reference"].norm()).item()
        wrapper = vars(L.LinearWithGradAccumulationAndAsyncCommunication)["backward"]
        print("live", type(wrapper).__name__, err < 1e-6)
    """, MICRO_BATCHES.replace("import torch, types, megatron.core.tensor_parallel.layers as L",
                                "import torch, types"), PRINT_STATES))
    assert out.returncode == 0, out.stderr
    assert "live PatchedTwin True" in out.stdout, out.stdout
    assert "ratio 1.0" in out.stdout, out.stdout
    assert states(out)["fsdp-wgrad"] == "verified"


@needs_call_site
def test_a_module_half_imported_by_another_thread_is_patched_once_it_is_done():
    """0.1.0's hook ran on the half-built module (NameError: name 'custom_bwd' is not defined)
    and never retried."""
    out = run(snippet("""
        import sys, threading, torch
        started, resume = threading.Event(), threading.Event()
        def tracer(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.endswith("tensor_parallel/layers.py") \\
                    and frame.f_code.co_name == "<module>":
                def local(frame, event, arg):
                    if event == "line" and frame.f_lineno > 60 and not started.is_set():
                        started.set()
                        resume.wait(30)
                    return local
                return local
            return None
        def importer():
            sys.settrace(tracer)
            import megatron.core.tensor_parallel.layers
        worker = threading.Thread(target=importer)
        worker.start()
        assert started.wait(120), "megatron's layers module never started executing"
        threading.Timer(1.0, resume.set).start()  # the import finishes while gemm_patch waits for it
        import gemm_patch
        worker.join()
        import megatron.core.tensor_parallel.layers as L
        from conftest import run_layer
        r = run_layer(torch.float32)
        err = ((r["main_grad"].double() - r["reference"]).norm() / r["reference"].norm()).item()
        print("patched", err < 1e-6)
    """, PRINT_STATES))
    assert out.returncode == 0, out.stderr
    assert "patched True" in out.stdout, out.stdout + out.stderr
    assert states(out)["fsdp-wgrad"] == "verified", out.stdout
    assert "internal error" not in out.stdout + out.stderr


def test_revert_puts_back_only_what_is_still_ours():
    """0.1.0's revert dropped a wrapper another library installed on top, silently."""
    out = run(snippet("""
        import gemm_patch, megatron.core.tensor_parallel.layers as L
        import megatron.core.distributed
        F = L.LinearWithGradAccumulationAndAsyncCommunication
        ours = vars(F)["backward"]
        theirs = staticmethod(lambda ctx, *grads: ours.__get__(None, F)(ctx, *grads))
        F.backward = theirs
        gemm_patch.revert()
        gemm_patch.revert()
        print("kept", vars(F)["backward"] is theirs)
    """, PRINT_STATES))
    assert out.returncode == 0, out.stderr
    if APPLICABLE:
        assert "kept True" in out.stdout, out.stdout
        assert states(out)["fsdp-wgrad"] == "replaced", out.stdout
        warnings = [line for line in out.stderr.splitlines() if "revert() left" in line]
        assert len(warnings) == 1 and warnings[0].startswith("[gemm_patch] WARNING:"), out.stderr
    assert states(out)["apex-wgrad"] == "off", out.stdout


@needs_call_site
def test_a_wrong_shape_main_grad_fails_clearly_through_megatrons_backward():
    """0.1.0 (overwrite mode) resized it: a (24, 17) view of a flat fp32 buffer was reshaped
    to (24, 16) with the tail left NaN."""
    out = run(snippet("""
        import torch, gemm_patch, megatron.core.tensor_parallel.layers as L
        flat = torch.full((80 * 65,), float("nan"))
        weight = torch.nn.Parameter(torch.randn(80, 64).to(torch.bfloat16))
        weight.__fsdp_param__ = True
        weight.main_grad = flat.view(80, 65)
        weight.get_main_grad = lambda: weight.main_grad
        x = torch.randn(96, 64).to(torch.bfloat16).requires_grad_()
        y = L.linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False)
        try:
            y.backward(torch.randn(y.shape).to(torch.bfloat16))
        except ValueError as exc:
            print("error", type(exc).__name__, str(exc)[:200])
        print("untouched", bool(flat.isnan().all()), tuple(weight.main_grad.shape))
    """))
    assert out.returncode == 0, out.stderr
    assert "error WgradOperandError gemm_patch: cannot write the weight gradient" in out.stdout, out.stdout
    assert "main_grad must be 80 x 64" in out.stdout
    assert "untouched True (80, 65)" in out.stdout, out.stdout
