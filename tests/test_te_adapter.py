"""The TE adapter's argument mapping for both general_gemm signatures.

A recording stand-in for ``general_gemm`` is the only fake here: the real TE path is
tested on the H200 (tests/gpu). The stand-in computes what TE documents for layout "NT"
(out = B^T-major product as megatron calls it), so the mapping is checked by value too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gemm_patch.gemm.backends import TransformerEngineBackend

ROOT = Path(__file__).resolve().parent.parent


def make_general_gemm(with_workspace: bool, calls: list):
    def compute(A, B, out, accumulate):
        product = B.double().t() @ A.double()  # grad_output^T @ total_input
        out.copy_(out.double() + product if accumulate else product)

    if with_workspace:
        def general_gemm(A, B, workspace, out_dtype=None, quantization_params=None, gelu=False,
                         gelu_in=None, accumulate=False, layout="TN", out=None, bias=None,
                         use_split_accumulator=False, grad=False, ub=None):
            calls.append(dict(A=A, B=B, workspace=workspace, out_dtype=out_dtype, layout=layout, out=out,
                              grad=grad, accumulate=accumulate, use_split_accumulator=use_split_accumulator))
            compute(A, B, out, accumulate)
    else:
        def general_gemm(A, B, out_dtype=None, quantization_params=None, gelu=False, gelu_in=None,
                         accumulate=False, layout="TN", out=None, bias=None, use_split_accumulator=False,
                         grad=False, ub=None):
            calls.append(dict(A=A, B=B, out_dtype=out_dtype, layout=layout, out=out, grad=grad,
                              accumulate=accumulate, use_split_accumulator=use_split_accumulator))
            compute(A, B, out, accumulate)
    return general_gemm


def run(with_workspace: bool, accumulate: bool):
    calls: list = []
    workspace = torch.empty(8, dtype=torch.uint8)
    backend = TransformerEngineBackend()
    backend.bind(make_general_gemm(with_workspace, calls), get_workspace=lambda: workspace)
    grad_output = torch.randn(32, 12).to(torch.bfloat16)
    total_input = torch.randn(32, 20).to(torch.bfloat16)
    out = torch.ones(12, 20)
    backend.gemm(grad_output.t(), total_input, out, accumulate)
    expected = grad_output.double().t() @ total_input.double() + (1.0 if accumulate else 0.0)
    return backend, calls, workspace, grad_output, total_input, out, expected


def test_new_signature_without_workspace():
    backend, calls, _, grad_output, total_input, out, expected = run(with_workspace=False, accumulate=False)
    assert not backend.takes_workspace
    (call,) = calls
    assert "workspace" not in call
    assert call["A"].data_ptr() == total_input.data_ptr()
    assert call["B"].data_ptr() == grad_output.data_ptr()
    assert (call["layout"], call["grad"], call["accumulate"], call["out_dtype"]) == ("NT", True, False, torch.float32)
    assert call["out"] is out and call["use_split_accumulator"] is False
    assert torch.allclose(out.double(), expected, rtol=1e-6, atol=1e-6)


def test_old_signature_gets_the_workspace_positionally():
    backend, calls, workspace, *_ , out, expected = run(with_workspace=True, accumulate=True)
    assert backend.takes_workspace
    (call,) = calls
    assert call["workspace"] is workspace
    assert call["accumulate"] is True
    assert torch.allclose(out.double(), expected, rtol=1e-6, atol=1e-6)


# A stand-in Transformer Engine whose import is slow: each package sleeps before importing the
# next level, and ``cpp_extensions`` imports back from its package, as TE's own does.
SLOW_TE = {
    "transformer_engine/__init__.py": "import time\ntime.sleep(2)\nfrom . import pytorch\n",
    "transformer_engine/pytorch/__init__.py": "import time\nfrom . import utils\ntime.sleep(2)\n"
                                              "from .cpp_extensions import general_gemm\n",
    "transformer_engine/pytorch/utils.py": "",
    "transformer_engine/pytorch/cpp_extensions.py": "from . import utils\n\ndef general_gemm(A, B, out=None):\n"
                                                    "    pass\n",
}
WHILE_TE_IMPORTS = """
import sys, threading, time, torch, gemm_patch
errors = []
def import_te():
    try:
        import transformer_engine
    except BaseException as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
thread = threading.Thread(target=import_te)
thread.start()
while "{reached}" not in sys.modules:
    time.sleep(0.01)
st = gemm_patch.{call}()
thread.join()
print("TE", st.backends["unavailable"].get("te"))
print("ERRORS", errors)
print("AFTER", gemm_patch.status().backends["unavailable"].get("te"))
"""


# status() while the import is inside transformer_engine.pytorch (0.4.0: that import raised
# _DeadlockError); apply() while it is inside transformer_engine, before the module apply() waits
# for exists (0.4.0: status() ran TE's package code itself, from the wrong thread).
@pytest.mark.parametrize("call,reached", [("status", "transformer_engine.pytorch"),
                                          ("apply", "transformer_engine")])
def test_describing_the_backends_never_imports_te_while_another_thread_does(tmp_path, call, reached):
    """0.4.0's status() imported transformer_engine.pytorch.cpp_extensions to describe TE, whoever
    else was importing it."""
    for name, text in SLOW_TE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "compat" / "isolate"), str(tmp_path), str(ROOT)])
    code = WHILE_TE_IMPORTS.replace("{call}", call).replace("{reached}", reached)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["ERRORS"] == "[]", out.stdout
    assert lines["TE"] == "transformer_engine is being imported; judged again once that import is done", out.stdout
    assert lines["AFTER"] == "None", "once imported, TE is judged (available) from sys.modules"
