"""WgradDispatcher: the one object every patched call site calls.

Hot path: one dict lookup keyed on (is CUDA, dtypes, accumulate) gives the ordered list of
backends able to run that combination; the first one runs. A backend that raises is demoted
for that key with a one-time warning and the next one runs, so the gradient is always
written. Backends validate before they launch work, so a raising backend has not written
``out``.
"""

from __future__ import annotations

import logging
import threading

import torch

from . import BACKEND_ORDER
from .backends import Backend, all_backends

log = logging.getLogger("gemm_patch")

DEFAULT_ORDER = BACKEND_ORDER  # why this order: gemm_patch/gemm/__init__.py


class WgradDispatcher:
    def __init__(self, backend: str = "auto", backends: dict[str, Backend] | None = None,
                 order: tuple[str, ...] = DEFAULT_ORDER) -> None:
        self.backends = backends if backends is not None else all_backends()
        self.forced = backend
        names = order if backend == "auto" else (backend, "fallback")
        # The exact fallback stays last even when a backend is forced: a gradient is never lost.
        self.order = tuple(dict.fromkeys(n for n in names if n in self.backends))
        self._plans: dict[tuple, tuple[Backend, ...]] = {}
        self._demoted: set[tuple[str, tuple]] = set()
        self._lock = threading.Lock()

    # -- the dispatch itself ----------------------------------------------------------------

    def gemm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        """``out = a @ b`` or, with ``accumulate``, ``out += a @ b``, into ``out`` as it is: a
        wrong shape, dtype or device is an error before anything is written (``torch``'s ``out=``
        would silently resize a mis-shaped buffer)."""
        _check_operands(a, b, out)
        if a.dtype == out.dtype and b.dtype == out.dtype:
            # The original call already works here; keep its exact numerics (and keep fp32
            # operands away from TE, which would run them in TF32).
            if accumulate:
                out.addmm_(a, b)
            else:
                torch.matmul(a, b, out=out)
            return
        # is_cuda, not device.type: building a torch.device costs ~0.3 us, and every backend
        # only distinguishes CUDA from the rest.
        key = (out.is_cuda, a.dtype, b.dtype, out.dtype, accumulate)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(key, a, b, out)
        for backend in plan:
            try:
                backend.gemm(a, b, out, accumulate)
                return
            except Exception as exc:
                if backend is plan[-1]:
                    raise
                self._demote(backend, key, exc)

    def plan_for(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 accumulate: bool = False, may_import: bool = True) -> tuple[str, ...]:
        """Names of the backends that would be tried, in order, for these operands
        (``may_import``: as ``Backend.unavailable_reason``)."""
        if a.dtype == out.dtype and b.dtype == out.dtype:
            return ("torch.matmul",)
        key = (out.is_cuda, a.dtype, b.dtype, out.dtype, accumulate)
        return tuple(b_.name for b_ in self._plans.get(key) or self._plan(key, a, b, out, may_import))

    def _plan(self, key, a, b, out, may_import: bool = True) -> tuple[Backend, ...]:
        plan = []
        for name in self.order:
            backend = self.backends[name]
            if (name, key) in self._demoted or backend.unavailable_reason(may_import) is not None:
                continue
            if backend.supports(a, b, out):
                plan.append(backend)
        result = tuple(plan)
        if not all(self.backends[name].judged for name in self.order):
            return result  # a backend not judged yet (TE not imported): planned again next time
        if self.forced not in ("auto", "fallback") and (not plan or plan[0].name != self.forced):
            reason = self.backends[self.forced].unavailable_reason() or "it cannot run these dtypes"
            _warn_once(f"forced:{self.forced}:{key}",
                       f"GEMM_PATCH_BACKEND={self.forced} cannot be used for {_describe(key)}: "
                       f"{reason}; using {plan[0].name if plan else 'nothing'}")
        with self._lock:
            self._plans[key] = result
        return result

    def _demote(self, backend: Backend, key, exc: Exception) -> None:
        with self._lock:
            self._demoted.add((backend.name, key))
            self._plans.pop(key, None)
        _warn_once(f"demote:{backend.name}:{key}",
                   f"backend {backend.name} failed for {_describe(key)} "
                   f"({type(exc).__name__}: {exc}); handing over to the next backend for "
                   f"these dtypes from now on")

    def in_use(self) -> dict[str, str]:
        """The backend that runs first, per case: of every plan made so far, else of the case
        the patched call sites send (bf16 x bf16 += fp32) on the current device, CUDA only where
        this process has initialised it (never creates a context)."""
        used = {_describe(key): plan[0].name for key, plan in self._plans.items() if plan}
        if used:
            return used
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else "cpu"
        probe = torch.empty(1, 1, dtype=torch.bfloat16, device=device)
        out = torch.empty(1, 1, dtype=torch.float32, device=device)
        key = (out.is_cuda, probe.dtype, probe.dtype, out.dtype, True)
        plan = self.plan_for(probe, probe, out, accumulate=True, may_import=False)
        return {_describe(key): plan[0] if plan else "none"}

    def describe(self) -> dict:
        """What status() shows; imports nothing (``may_import=False``)."""
        return {
            "in_use": self.in_use(),
            "order": list(self.order),
            "forced": self.forced,
            "unavailable": {n: r for n in self.order
                            if (r := self.backends[n].unavailable_reason(may_import=False)) is not None},
            "demoted": sorted(f"{n} for {_describe(k)}" for n, k in self._demoted),
        }


class WgradOperandError(ValueError):
    """The operands cannot make this weight gradient; nothing was written."""


_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_operands(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    # On the hot path: shapes as tuples, devices as ints (get_device), dtypes by identity; a
    # torch.device comparison alone would cost ~0.3 us.
    a_shape, b_shape, out_shape = a.shape, b.shape, out.shape
    if (len(a_shape) == 2 and len(b_shape) == 2 and len(out_shape) == 2 and a_shape[1] == b_shape[0]
            and out_shape[0] == a_shape[0] and out_shape[1] == b_shape[1] and a.dtype is b.dtype
            and out.dtype in _OUT_DTYPES and out.get_device() == a.get_device() == b.get_device()):
        return
    raise WgradOperandError(
        f"gemm_patch: cannot write the weight gradient grad_output^T @ input "
        f"({_tensor(a)} @ {_tensor(b)}) into main_grad {_tensor(out)}: main_grad must be "
        f"{a.shape[0] if a.dim() == 2 else '?'} x {b.shape[1] if b.dim() == 2 else '?'} "
        f"(the weight's shape), on {a.device}, one of fp32/bf16/fp16, and both operands one dtype; "
        "nothing was written")


def _tensor(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"


def _describe(key) -> str:
    is_cuda, a_dtype, b_dtype, out_dtype, accumulate = key
    op = "+=" if accumulate else "="
    return f"{'cuda' if is_cuda else 'non-cuda'} {str(out_dtype).removeprefix('torch.')} {op} " \
           f"{str(a_dtype).removeprefix('torch.')} x {str(b_dtype).removeprefix('torch.')}"


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)

