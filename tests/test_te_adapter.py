"""The TE adapter's argument mapping for both general_gemm signatures.

A recording stand-in for ``general_gemm`` is the only fake here: the real TE path is
tested on the H200 (tests/gpu). The stand-in computes what TE documents for layout "NT"
(out = B^T-major product as megatron calls it), so the mapping is checked by value too."""

from __future__ import annotations

import torch

from gemm_patch.gemm.backends import TransformerEngineBackend


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
