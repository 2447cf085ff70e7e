"""The GEMM backends the dispatcher chooses from.

Each computes ``out = a @ b`` (or ``out += a @ b`` with ``accumulate``) with fp32 accumulation
and the result rounded once into ``out.dtype``. ``a`` is ``grad_output.t()`` (M x K) and ``b``
is ``total_input`` (K x N), exactly the operands of the megatron-core call it replaces.

This module imports torch; it is only imported once a target module (which imports torch
itself) is being patched, or by the CLI.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch

from ..support.module_state import importing, module_findable
from . import BACKEND_ORDER

_HALF = (torch.bfloat16, torch.float16)


class Backend:
    """One way to run the wgrad GEMM. ``unavailable_reason`` is None when it can run here."""

    name = "backend"
    judged = True  # False: unavailable_reason() is provisional, asked again next time

    def unavailable_reason(self, may_import: bool = True) -> str | None:
        """Why it cannot run here, else None. ``may_import`` False (describing, not running a
        GEMM): what it needs is looked up in ``sys.modules`` only."""
        return None

    def supports(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
        raise NotImplementedError

    def gemm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        raise NotImplementedError


def _cublas_pair(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    # cuBLAS (through TE or torch) takes 16-bit inputs into fp32 or the same 16-bit type;
    # bf16 -> fp16 and anything from fp32 inputs is left to the exact fallback.
    return (
        out.is_cuda
        and a.dtype in _HALF
        and b.dtype == a.dtype
        and out.dtype in (torch.float32, a.dtype)
    )


class TransformerEngineBackend(Backend):
    """TE's ``general_gemm``, through our own adapter for both of its signatures.

    TE < 2.10 takes a ``workspace`` tensor as third argument (from ``get_workspace()``);
    TE >= 2.10 dropped both. megatron-core <= 0.16's own wrapper imports ``get_workspace``
    unconditionally and so is ``None`` with a newer TE, which is why we don't call it.
    """

    name = "te"
    module = "transformer_engine.pytorch.cpp_extensions"

    def __init__(self) -> None:
        self._gemm_fn: Callable | None = None
        self._workspace_fn: Callable | None = None
        self._reason: str | None = None
        self._loaded = False

    @property
    def judged(self) -> bool:
        return self._loaded

    def _load(self, may_import: bool) -> None:
        # Another thread's import of TE would meet this one halfway (importlib's _DeadlockError
        # in that thread, a training job's import); a status() call must not import TE at all.
        if importing(self.module):
            self._reason = "transformer_engine is being imported; judged again once that import is done"
            return
        if (not may_import and self.module not in sys.modules
                and module_findable("transformer_engine") is not False):
            self._reason = "transformer_engine not imported in this process yet; judged when a GEMM needs it"
            return
        self._loaded = True
        try:
            from transformer_engine.pytorch.cpp_extensions import general_gemm
        except Exception as exc:  # ImportError, or a broken TE build raising OSError etc.
            self._reason = f"transformer_engine not importable ({type(exc).__name__}: {exc})"
            return
        self.bind(general_gemm)

    def bind(self, general_gemm: Callable, get_workspace: Callable | None = None) -> None:
        """Adopt a ``general_gemm``; look up ``get_workspace`` when its signature wants one."""
        self._loaded = True
        self._gemm_fn = general_gemm
        self._reason = None
        try:
            takes_workspace = "workspace" in inspect.signature(general_gemm).parameters
        except (TypeError, ValueError):
            takes_workspace = False
        if takes_workspace and get_workspace is None:
            from transformer_engine.pytorch.module.base import get_workspace
        self._workspace_fn = get_workspace if takes_workspace else None

    @property
    def takes_workspace(self) -> bool:
        return self._workspace_fn is not None

    def unavailable_reason(self, may_import: bool = True) -> str | None:
        if not self._loaded:
            self._load(may_import)
        return self._reason

    def supports(self, a, b, out) -> bool:
        return _cublas_pair(a, b, out)

    def gemm(self, a, b, out, accumulate) -> None:
        # megatron's call is general_gemm(total_input, grad_output, layout="NT"), i.e. TE's
        # column-major view of grad_output^T @ total_input; a.t() is grad_output again.
        kwargs = dict(
            out_dtype=out.dtype,
            layout="NT",
            out=out,
            grad=True,
            accumulate=accumulate,
            use_split_accumulator=False,
        )
        total_input, grad_output = b.contiguous(), a.t().contiguous()
        if self._workspace_fn is not None:
            self._gemm_fn(total_input, grad_output, self._workspace_fn(), **kwargs)
        else:
            self._gemm_fn(total_input, grad_output, **kwargs)


class NativeTorchBackend(Backend):
    """``torch.mm``/``torch.addmm`` with ``out_dtype``: cuBLAS writes fp32 from 16-bit inputs."""

    name = "native"

    def unavailable_reason(self, may_import: bool = True) -> str | None:
        if not hasattr(torch.ops.aten.mm, "dtype_out"):
            return f"torch {torch.__version__} has no mm(..., out_dtype=)"
        if not torch.cuda.is_available():
            return "no CUDA device (torch's out_dtype matmul has CUDA kernels only)"
        return None

    def supports(self, a, b, out) -> bool:
        return _cublas_pair(a, b, out) and out.dtype == torch.float32

    def gemm(self, a, b, out, accumulate) -> None:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)


class ExactFallbackBackend(Backend):
    """Upcast to fp32 (fp64 if anything is fp64), multiply, round once into ``out``.

    Runs on any device and dtype pair. Memory beyond the operands and ``out``, with ``a`` M x K,
    ``b`` K x N, ``out`` M x N and w the wide type's bytes (4, fp64: 8); each is one temporary
    the exact product cannot do without, alive during the one GEMM:

    - ``out`` already wide (16-bit inputs into an fp32 ``main_grad``): a wide copy of each
      narrower operand, w x (MK + KN), no more: the GEMM runs in place in ``out``;
    - ``out`` narrower (16-bit ``main_grad``): one wide M x N buffer on top, w x MN, which
      holds ``out``'s upcast, takes the GEMM in place and is rounded once into ``out``.

    Fewer would change the bits: a GEMM over row blocks may sum in another order (cuBLAS picks
    split-K by shape), and ``out.add_(a @ b)`` adds ``out`` after the products where the GEMM's
    beta=1 adds it before them."""

    name = "fallback"

    def supports(self, a, b, out) -> bool:
        return True

    def gemm(self, a, b, out, accumulate) -> None:
        wide = torch.float64 if torch.float64 in (a.dtype, b.dtype, out.dtype) else torch.float32
        a_wide, b_wide = a.to(wide), b.to(wide)
        if out.dtype == wide:
            if accumulate:
                out.addmm_(a_wide, b_wide)
            else:
                torch.mm(a_wide, b_wide, out=out)
        elif accumulate:
            # In place in one contiguous wide copy of out: beta=1 into a contiguous M x N,
            # with no second M x N buffer for the product.
            acc = out.to(wide, memory_format=torch.contiguous_format)
            acc.addmm_(a_wide, b_wide)
            out.copy_(acc)
        else:
            out.copy_(torch.mm(a_wide, b_wide))


def all_backends() -> dict[str, Backend]:
    """One fresh instance of each backend of this module, by name, in the default preference
    order (``BACKEND_ORDER``, which names every one of them)."""
    classes = {cls.name: cls for cls in Backend.__subclasses__() if cls.__module__ == __name__}
    return {name: classes[name]() for name in BACKEND_ORDER}
