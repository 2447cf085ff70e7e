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

from .backends import Backend, all_backends

log = logging.getLogger("gemm_patch")

# native first: on the H200 (torch 2.11, TE 2.20.2) native and TE gave bitwise-identical
# main_grads (also identical to megatron-core 0.19.2's own TE call) at the same GPU time, and
# native costs 14.6 us of host time per call against TE's 48 us (benchmarks/results/). TE stays
# next for torch builds without mm(..., out_dtype=).
DEFAULT_ORDER = ("native", "te", "fallback")


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

    # -- megatron-facing entry points -------------------------------------------------------

    def fsdp_wgrad(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor, param=None):
        """Stands in for ``torch.matmul(grad_output.t(), total_input, out=weight.main_grad)``,
        but accumulates (``out += a @ b``) where ``out`` is Megatron-FSDP's persistent
        gradient buffer: overwriting it would keep only the last micro-batch's gradient."""
        self.gemm(a, b, out, accumulate=param is not None and main_grad_is_persistent(param))
        return out

    def apex_wgrad(self, total_input: torch.Tensor, grad_output: torch.Tensor,
                   main_grad: torch.Tensor) -> None:
        """Stands in for apex's ``wgrad_gemm_accum_fp32/fp16(total_input, grad_output,
        main_grad)``: ``main_grad += grad_output^T @ total_input`` in place."""
        # apex folds leading dimensions into the token dimension ([s, b, h] -> [s*b, h]);
        # megatron passes 2-D tensors already, for which reshape is a no-op view.
        total_input = total_input.reshape(-1, total_input.shape[-1])
        grad_output = grad_output.reshape(-1, grad_output.shape[-1])
        self.gemm(grad_output.t(), total_input, main_grad, accumulate=True)

    # -- the dispatch itself ----------------------------------------------------------------

    def gemm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
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
                if not _shapes_match(a, b, out):
                    raise  # the caller's mistake, not the backend's: don't demote anything
                if backend is plan[-1]:
                    raise
                self._demote(backend, key, exc)

    def plan_for(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 accumulate: bool = False) -> tuple[str, ...]:
        """Names of the backends that would be tried, in order, for these operands."""
        if a.dtype == out.dtype and b.dtype == out.dtype:
            return ("torch.matmul",)
        key = (out.is_cuda, a.dtype, b.dtype, out.dtype, accumulate)
        return tuple(b_.name for b_ in self._plans.get(key) or self._plan(key, a, b, out))

    def _plan(self, key, a, b, out) -> tuple[Backend, ...]:
        plan = []
        for name in self.order:
            backend = self.backends[name]
            if (name, key) in self._demoted or backend.unavailable_reason() is not None:
                continue
            if backend.supports(a, b, out):
                plan.append(backend)
        if self.forced not in ("auto", "fallback") and (not plan or plan[0].name != self.forced):
            reason = self.backends[self.forced].unavailable_reason() or "it cannot run these dtypes"
            _warn_once(f"forced:{self.forced}:{key}",
                       f"GEMM_PATCH_BACKEND={self.forced} cannot be used for {_describe(key)}: "
                       f"{reason}; using {plan[0].name if plan else 'nothing'}")
        result = tuple(plan)
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

    def describe(self) -> dict:
        return {
            "order": list(self.order),
            "forced": self.forced,
            "unavailable": {n: r for n in self.order
                            if (r := self.backends[n].unavailable_reason()) is not None},
            "demoted": sorted(f"{n} for {_describe(k)}" for n, k in self._demoted),
        }


def main_grad_is_persistent(param) -> bool:
    """Whether ``param.get_main_grad()`` returns Megatron-FSDP's persistent gradient buffer
    (which holds the sum over the step's micro-batches, so a weight gradient must be added to
    it) rather than a communication bucket allocated for this backward and reduced before the
    next one (which must be overwritten: it is not zeroed and holds stale data).

    Megatron-FSDP (megatron-core 0.14-0.19) sets ``param._gbuf`` to the parameter's gradient
    buffer; its ``main_grad_getter`` calls ``_gbuf.fetch_bucket()``, which returns a view of the
    buffer's own storage exactly when ``not _gbuf.is_data_distributed`` (``no_shard``/``optim``,
    or any strategy on a single data-parallel rank), and a temporary bucket otherwise. Without
    ``_gbuf`` it is not Megatron-FSDP's buffer: keep the overwrite of the call this replaces.
    """
    gbuf = getattr(param, "_gbuf", None)
    if gbuf is None:
        return False
    return not getattr(gbuf, "is_data_distributed", True)


def _shapes_match(a, b, out) -> bool:
    return a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0] and \
        tuple(out.shape) == (a.shape[0], b.shape[1])


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


_active: WgradDispatcher | None = None


def active_dispatcher() -> WgradDispatcher:
    """The process-wide dispatcher, built on first use from the current configuration."""
    global _active
    if _active is None:
        from . import config

        try:
            backend = config.load().backend
        except config.ConfigError:
            backend = "auto"  # the bad value was already reported when the patch was applied
        _active = WgradDispatcher(backend)
    return _active


def reset_active_dispatcher() -> None:
    global _active
    _active = None


def fsdp_wgrad(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor, param=None):
    """What the patched megatron-core call site calls; looks the dispatcher up per call so a
    reconfigured or reset dispatcher takes effect without re-patching."""
    return (_active or active_dispatcher()).fsdp_wgrad(a, b, out=out, param=param)


def apex_wgrad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """What gemm_patch's stand-in for apex's ``fused_weight_gradient_mlp_cuda`` calls; looks the
    dispatcher up per call, like ``fsdp_wgrad``."""
    (_active or active_dispatcher()).apex_wgrad(total_input, grad_output, main_grad)


def fsdp_wgrad_te(total_input: torch.Tensor, grad_output: torch.Tensor, *, out: torch.Tensor, param=None,
                  **te_kwargs) -> None:
    """Stands in for megatron-core 0.18+'s own ``te_general_gemm(total_input, grad_output,
    out_dtype=main_grad.dtype, layout="NT", out=main_grad, grad=True)`` on the Megatron-FSDP
    path (reached only where megatron found TE). Where the buffer is fresh that very call runs,
    unchanged; where it persists, the product is added through the dispatcher instead, since
    that call's overwrite would drop the earlier micro-batches."""
    if param is not None and main_grad_is_persistent(param):
        (_active or active_dispatcher()).gemm(grad_output.t(), total_input, out, accumulate=True)
        return
    from megatron.core.extensions.transformer_engine import te_general_gemm

    te_general_gemm(total_input, grad_output, out=out, **te_kwargs)
