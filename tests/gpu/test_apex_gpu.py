"""apex's two wgrad kernels as gemm_patch provides them, on the GPU (written for an H200 with
TE 2.20.2 and megatron-core 0.17.1, no apex): both accumulate paths against fp64, TE's path
bitwise against TE's own accumulate call, and a megatron-core layer built with fusion on and
trained through the stand-in."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from gemm_patch.dispatcher import WgradDispatcher  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent.parent
SHAPES = [(4096, 1024, 2048), (1000, 768, 3072), (8192, 4096, 4096)]  # (tokens, in, out)
DTYPES = [torch.bfloat16, torch.float16]


def operands(tokens, k, n, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total_input = torch.randn(tokens, k, device="cuda", generator=gen).to(dtype)
    grad_output = torch.randn(tokens, n, device="cuda", generator=gen).to(dtype)
    return total_input, grad_output


def start_value(n, k):
    gen = torch.Generator(device="cuda").manual_seed(99)
    return torch.randn(n, k, device="cuda", generator=gen) * 10  # accumulate onto what is there


def te_accumulate(total_input, grad_output, main_grad):
    """TE's own accumulate call, as megatron-core 0.19's TE path writes it."""
    try:
        from transformer_engine.pytorch.cpp_extensions import general_gemm
    except Exception as exc:
        pytest.skip(f"transformer_engine not importable: {exc}")
    args = [total_input, grad_output]
    if "workspace" in inspect.signature(general_gemm).parameters:  # TE < 2.10
        from transformer_engine.pytorch.module.base import get_workspace

        args.append(get_workspace())
    general_gemm(*args, out_dtype=main_grad.dtype, layout="NT", out=main_grad, grad=True, accumulate=True)


def dispatcher(backend: str) -> WgradDispatcher:
    disp = WgradDispatcher(backend)
    reason = disp.backends[backend].unavailable_reason()
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    return disp


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["te", "native"])
def test_accumulate_two_passes_matches_fp64(backend, dtype, shape):
    if backend == "native" and dtype == torch.float16:
        pass  # cuBLAS takes fp16 -> fp32 like bf16 -> fp32
    tokens, k, n = shape
    disp = dispatcher(backend)
    main_grad = start_value(n, k)
    expected = main_grad.double()
    for seed in (1, 2):
        total_input, grad_output = operands(tokens, k, n, dtype, seed)
        assert disp.plan_for(grad_output.t(), total_input, main_grad, accumulate=True)[0] == backend
        disp.apex_wgrad(total_input, grad_output, main_grad)
        expected += grad_output.double().t() @ total_input.double()
    torch.cuda.synchronize()
    assert not torch.isnan(main_grad).any()
    rel = ((main_grad.double() - expected).norm() / expected.norm()).item()
    assert rel < 1e-5, rel


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_te_path_is_bitwise_tes_own_accumulate_call(dtype, shape):
    tokens, k, n = shape
    disp = dispatcher("te")
    ours, theirs = start_value(n, k), start_value(n, k)
    for seed in (1, 2):
        total_input, grad_output = operands(tokens, k, n, dtype, seed)
        disp.apex_wgrad(total_input, grad_output, ours)
        te_accumulate(total_input, grad_output, theirs)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max().item()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_native_path_against_tes_own_accumulate_call(shape):
    """Not necessarily bitwise (cuBLAS may choose another kernel for torch's out_dtype addmm);
    the difference must stay at fp32 rounding level. Prints whether it was bitwise."""
    tokens, k, n = shape
    disp = dispatcher("native")
    ours, theirs = start_value(n, k), start_value(n, k)
    total_input, grad_output = operands(tokens, k, n, torch.bfloat16, 1)
    disp.apex_wgrad(total_input, grad_output, ours)
    te_accumulate(total_input, grad_output, theirs)
    rel = ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item()
    print(f"native vs TE accumulate {shape}: bitwise={torch.equal(ours, theirs)} rel={rel:.2e}")
    assert rel < 1e-6, rel


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_16bit_main_grad_accumulates_in_its_own_dtype(dtype):
    """apex's wgrad_gemm_accum_fp16: main_grad in the operands' dtype, fp32 accumulation, one
    rounding per pass; the dispatcher runs it as main_grad.addmm_ (cuBLAS, beta=1)."""
    tokens, k, n = SHAPES[0]
    main_grad = start_value(n, k).to(dtype)
    expected = main_grad.clone()
    theirs = main_grad.clone()
    for seed in (1, 2):
        total_input, grad_output = operands(tokens, k, n, dtype, seed)
        WgradDispatcher("auto").apex_wgrad(total_input, grad_output, main_grad)
        te_accumulate(total_input, grad_output, theirs)
        expected = (expected.double() + grad_output.double().t() @ total_input.double()).to(dtype)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(main_grad.double(), expected.double(), rtol=2 * eps, atol=1e-2)
    torch.testing.assert_close(main_grad.double(), theirs.double(), rtol=2 * eps, atol=1e-2)


# -- megatron-core's own layers, in a fresh interpreter ------------------------------------------

_TRAIN = """
import json, sys, torch
sys.path.insert(0, {megatron_tests!r})
import gemm_patch
from megatron_cpu import build, model_parallel
import megatron.core.tensor_parallel.layers as L
from gemm_patch.dispatcher import active_dispatcher

report = {{"status": gemm_patch.status().as_dict(), "losses": [], "rel": []}}
with model_parallel():
    column, row = build("column", 1024, 4096).cuda(), build("row", 4096, 1024).cuda()
    weights = [column.weight, row.weight]
    for w in weights:
        w.main_grad = torch.zeros(w.shape, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 4, 1024, device="cuda", generator=gen).to(torch.bfloat16)
    target = torch.randn(256, 4, 1024, device="cuda", generator=gen).to(torch.bfloat16)
    probe = torch.empty(1, 1, device="cuda", dtype=torch.bfloat16)
    report["backend"] = active_dispatcher().plan_for(probe, probe, probe.float(), accumulate=True)[0]
    for it in range(8):
        for w in weights:
            w.main_grad.zero_()
        expected = None
        for micro in range(2):  # two micro-batches accumulate into main_grad
            h, _ = column(x)
            h.retain_grad()
            y, _ = row(torch.nn.functional.gelu(h))
            loss = torch.nn.functional.mse_loss(y.float(), target.float())
            loss.backward()
            g = h.grad.reshape(-1, h.shape[-1]).double().t() @ x.reshape(-1, 1024).double()
            expected = g if expected is None else expected + g
        report["losses"].append(loss.item())
        mg = column.weight.main_grad.double()
        report["rel"].append(((mg - expected).norm() / expected.norm()).item())
        with torch.no_grad():
            for w in weights:
                w -= 0.5 * w.main_grad.to(w.dtype)
print(json.dumps(report))
"""


def test_megatron_layers_built_with_fusion_train_without_apex():
    env = dict(os.environ)
    if importlib.util.find_spec("megatron") is None:
        from conftest import mcore_dir  # the device kit's layout (/tmp/gp/mc0171)

        env["PYTHONPATH"] = os.pathsep.join([str(mcore_dir("0.17.1")), str(ROOT), env.get("PYTHONPATH", "")])
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = textwrap.dedent(_TRAIN.format(megatron_tests=str(ROOT / "tests" / "megatron")))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    status = report["status"]
    print(status["versions"], report["backend"], report["losses"], report["rel"])
    assert status["apex"] == "provided", status
    apex = {t["name"]: t for t in status["targets"]}["apex-wgrad"]
    assert apex["state"] == "verified", apex
    assert report["backend"] == "te"
    assert max(report["rel"]) < 1e-5, report["rel"]
    assert report["losses"][-1] < report["losses"][0], report["losses"]
