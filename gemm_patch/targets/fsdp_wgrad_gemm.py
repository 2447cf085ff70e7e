"""fsdp-wgrad-gemm: Megatron-LM main's ``_wgrad_gemm(weight.main_grad, grad_output, total_input)``
in ``LinearWithGradAccumulationAndAsyncCommunication.backward`` (the Megatron-FSDP branch of
gradient-accumulation fusion), where it must add.

main (unreleased megatron-core 0.20, Megatron-LM PR #6624) replaced 0.14-0.19's
``torch.matmul(..., out=weight.main_grad)`` (fsdp-wgrad) with ``_wgrad_gemm``: TE's GEMM into
``out`` without accumulation, or ``out.copy_(grad_output.t().matmul(total_input))`` without TE.
Either overwrites: right for a bucket allocated for this backward, wrong for Megatron-FSDP's
persistent buffer (``no_shard``/``optim``, or any strategy on one data-parallel rank) and for a
weight written twice in one backward (``wgrad_accumulates``). There the product is added through
the dispatcher; everywhere else megatron's own ``_wgrad_gemm`` runs, unchanged. The other
``_wgrad_gemm`` call of that backward (GTP's sharded wgrad tensor) is not touched.

It shares fsdp-wgrad's switch, GEMM_PATCH_FSDP_WGRAD: the same fix for the same branch, of which
a given release has one form or the other (the other target reads "not applicable").
"""

from __future__ import annotations

from typing import Any

from .fsdp_wgrad import DUMMY_CALLS, CallSiteTarget, wgrad_accumulates

CALL = "_wgrad_gemm(weight.main_grad, grad_output, total_input)"
MODULE = "megatron.core.tensor_parallel.layers"
# Megatron-LM main, pinned (megatron-core reports "0.20.0", plus "+<short hash>" in a checkout).
MAIN_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


def fsdp_wgrad_gemm(out: Any, grad_output: Any, total_input: Any, *, param: Any = None) -> Any:
    """Stands in for ``_wgrad_gemm(weight.main_grad, grad_output, total_input)``."""
    if wgrad_accumulates(param):
        from ..dispatcher import active_dispatcher

        active_dispatcher().gemm(grad_output.t(), total_input, out, accumulate=True)
        return out
    import sys

    # Megatron's own function, looked up as the original call would: in the module, now.
    return sys.modules[MODULE]._wgrad_gemm(out, grad_output, total_input)


TARGET = CallSiteTarget(
    name="fsdp-wgrad-gemm",
    distribution="megatron-core",
    module=MODULE,
    switch="GEMM_PATCH_FSDP_WGRAD",
    owner="LinearWithGradAccumulationAndAsyncCommunication",
    attribute="backward",
    relies_on="backward",
    call=CALL,
    replacement=fsdp_wgrad_gemm,
    also={},
    dummies=DUMMY_CALLS,
    fingerprints={
        # 0.13.x-0.19.x: no such call (fsdp-wgrad's torch.matmul instead): not applicable.
        f"main@{MAIN_COMMIT[:8]}": "5bed6b0307f4975f",
    },
)
