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
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from gemm_patch.gemm import active as dispatch  # noqa: E402
from gemm_patch.gemm.dispatcher import WgradDispatcher  # noqa: E402
from gemm_patch.targets.apex_wgrad import apex_wgrad  # noqa: E402


def run_apex(disp: WgradDispatcher, total_input, grad_output, main_grad) -> None:
    """The stand-in's entry point (apex's wgrad_gemm_accum_fp32/fp16), through ``disp``."""
    dispatch._active = disp
    try:
        apex_wgrad(total_input, grad_output, main_grad)
    finally:
        dispatch.reset_active_dispatcher()

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
    tokens, k, n = shape
    disp = dispatcher(backend)
    main_grad = start_value(n, k)
    expected = main_grad.double()
    for seed in (1, 2):
        total_input, grad_output = operands(tokens, k, n, dtype, seed)
        assert disp.plan_for(grad_output.t(), total_input, main_grad, accumulate=True)[0] == backend
        run_apex(disp, total_input, grad_output, main_grad)
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
        run_apex(disp, total_input, grad_output, ours)
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
    run_apex(disp, total_input, grad_output, ours)
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
        run_apex(WgradDispatcher("auto"), total_input, grad_output, main_grad)
        te_accumulate(total_input, grad_output, theirs)
        expected = expected.double() + grad_output.double().t() @ total_input.double()
    # A 16-bit buffer is rounded after every pass (and cuBLAS may reduce split-K partials in
    # 16 bits), so hold it to TE's own accumulate call on the same data: no worse than 1.5x
    # TE's error against the fp64 sum, and within a few 16-bit ulps overall.
    ours = ((main_grad.double() - expected).norm() / expected.norm()).item()
    tes = ((theirs.double() - expected).norm() / expected.norm()).item()
    print(f"{dtype}: rel. error vs fp64 sum: dispatcher {ours:.2e}, TE accumulate {tes:.2e}")
    assert ours <= 1.5 * tes + 1e-7, (ours, tes)
    assert ours < 4 * torch.finfo(dtype).eps, ours


# -- megatron-core's own layers, in a fresh interpreter ------------------------------------------


def test_megatron_layers_built_with_fusion_train_without_apex():
    """examples/apex_free_fusion.py on the GPU: Column/RowParallelLinear with fusion on, apex
    absent, eight SGD steps of two micro-batches from fp32 main_grad, checked against fp64."""
    env = dict(os.environ)
    if importlib.util.find_spec("megatron") is None:
        from conftest import mcore_dir  # the device kit's layout (/tmp/gp/mc0171)

        env["PYTHONPATH"] = os.pathsep.join([str(mcore_dir("0.17.1")), str(ROOT), env.get("PYTHONPATH", "")])
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "apex_free_fusion.py"), "--json"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(report["versions"], report["backend"], report["losses"], report["main_grad_rel_err"])
    assert report["device"] == "cuda"
    assert report["apex"] == "provided", report["apex_wgrad"]
    assert report["apex_wgrad"]["state"] == "verified", report["apex_wgrad"]
    assert report["fusion"] == [True, True]
    assert report["backend"] == "native"  # the default order on a torch with out_dtype matmul
    assert max(report["main_grad_rel_err"]) < 1e-5, report["main_grad_rel_err"]
    assert report["losses"][-1] < report["losses"][0], report["losses"]
    assert proc.returncode == 0
