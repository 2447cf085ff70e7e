"""moe-router-wgrad: a GEMM that writes the MoE router's weight gradient straight into ``main_grad``
(Megatron-LM PR #6943's design for an fp32 router, through a new ``accumulate`` argument of
megatron's ``te_general_gemm``) is a fused writer gemm-patch has not verified under
Megatron-FSDP's buffers: where the router's code has one, the target reads ``unverified`` and
leaves it to megatron (strict mode refuses it); on this release's router, which has none, ``not
applicable``. The stand-in is a router module written here after that design."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from conftest import EXPECTED

import gemm_patch
from gemm_patch.engine import config
from gemm_patch.engine.target import NOT_APPLICABLE, UNVERIFIED, Refused
from gemm_patch.targets import router_wgrad

pytestmark = pytest.mark.proves("moe-router-wgrad")

STAND_IN = textwrap.dedent('''
    import torch

    def te_general_gemm(A, B, out_dtype=None, layout="TN", out=None, bias=None, grad=False, accumulate=False):
        raise NotImplementedError

    class RouterGatingLinearFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, inp, weight):
            ctx.save_for_backward(inp, weight)
            return inp @ weight.t()

        @staticmethod
        def backward(ctx, grad_output):
            inp, weight = ctx.saved_tensors
            if getattr(weight, "main_grad", None) is not None:
                te_general_gemm(inp, grad_output, out_dtype=weight.main_grad.dtype, layout="NT",
                                out=weight.main_grad, grad=True, accumulate=True)
                return grad_output @ weight, None
            return grad_output @ weight, grad_output.t() @ inp
''')


def stand_in(tmp_path):
    path = tmp_path / "router_stand_in.py"
    path.write_text(STAND_IN)
    spec = importlib.util.spec_from_file_location("router_stand_in", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_this_releases_router_has_no_such_writer():
    gemm_patch.apply()
    st = {t.name: t for t in gemm_patch.status().targets}["moe-router-wgrad"]
    assert st.state == EXPECTED["moe-router-wgrad"] == NOT_APPLICABLE, st.reason


def test_a_router_that_writes_main_grad_itself_is_reported_and_left_alone(tmp_path):
    module = stand_in(tmp_path)
    before = dict(vars(module))
    st, undo = router_wgrad.TARGET.patch(module, "0.20.0", config.Config())
    assert st.state == UNVERIFIED, st.reason
    assert "RouterGatingLinearFunction" in st.reason and "left alone" in st.reason, st.reason
    assert not undo.steps and dict(vars(module)) == before
    with pytest.raises(Refused, match="GEMM_PATCH_STRICT=1"):
        router_wgrad.TARGET.patch(module, "0.20.0", config.Config(strict=True))


def test_other_gemms_are_not_writers():
    import ast

    calls = [ast.parse(code, mode="eval").body for code in (
        "te_general_gemm(a, b, out=buffer)", "torch.matmul(a, b, out=weight.main_grad)", "general_gemm(a, b)")]
    assert [router_wgrad.writes_main_grad(c) for c in calls] == [False, False, False]
    assert router_wgrad.writes_main_grad(ast.parse("gemm.te_general_gemm(a, b, out=w.main_grad)", mode="eval").body)
