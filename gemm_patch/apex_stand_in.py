"""A stand-in for apex's compiled extension ``fused_weight_gradient_mlp_cuda``.

megatron-core calls two of its functions for non-FSDP weights with gradient-accumulation
fusion on, both meaning ``main_grad += grad_output^T @ total_input`` in place with fp32
accumulation. The stand-in is a plain module object whose two functions send that to the
WgradDispatcher with ``accumulate=True``; it is only ever installed where apex's own extension
failed to import, so a real apex is never shadowed.
"""

from __future__ import annotations

import importlib.machinery
import types
from typing import Any

EXTENSION = "fused_weight_gradient_mlp_cuda"
_MARKER = "__gemm_patch_stand_in__"


def wgrad_gemm_accum_fp32(total_input: Any, grad_output: Any, main_grad: Any) -> None:
    """apex: ``main_grad (fp32) += grad_output^T @ total_input``, 16-bit or fp32 operands."""
    from .dispatcher import apex_wgrad

    apex_wgrad(total_input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(total_input: Any, grad_output: Any, main_grad: Any) -> None:
    """apex: ``main_grad (fp16/bf16, the operands' dtype) += grad_output^T @ total_input``."""
    from .dispatcher import apex_wgrad

    apex_wgrad(total_input, grad_output, main_grad)


def _build() -> types.ModuleType:
    module = types.ModuleType(EXTENSION, "gemm_patch's stand-in for apex's fused_weight_gradient_mlp_cuda "
                                         "(apex's extension is not importable here).")
    # A spec makes importlib.util.find_spec(EXTENSION) answer instead of raising ValueError
    # for a sys.modules entry whose __spec__ is None.
    module.__spec__ = importlib.machinery.ModuleSpec(EXTENSION, loader=None, origin="gemm_patch")
    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16
    setattr(module, _MARKER, True)
    return module


STAND_IN: types.ModuleType = _build()
"""One object per process, so identity checks (``layers.fused_weight_gradient_mlp_cuda is
sys.modules[...]``) hold across apply/revert cycles."""


def is_stand_in(obj: object) -> bool:
    """True for this stand-in, and for one built by another copy of gemm_patch."""
    return isinstance(obj, types.ModuleType) and getattr(obj, _MARKER, False) is True
