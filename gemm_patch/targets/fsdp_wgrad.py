"""fsdp-wgrad: megatron-core's ``torch.matmul(grad_output.t(), total_input, out=weight.main_grad)``
in ``LinearWithGradAccumulationAndAsyncCommunication.backward`` (the Megatron-FSDP branch of
gradient-accumulation fusion), sent to the WgradDispatcher.

``torch.matmul`` cannot write a bf16 product into an fp32 main_grad; the dispatcher can. It
also decides, per call, whether to overwrite or add (``wgrad_accumulates``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import wrapt

from ..callsite import Redirect, build_twin, check_live_is_source, find_call_site, find_calls
from .base import Inspection, MethodTarget, Undo

CALL = "torch.matmul(grad_output.t(), total_input, out=weight.main_grad)"
# 0.18+: megatron's own TE call beside it overwrites too; routed so it adds where it must.
TE_CALL = ('te_general_gemm(total_input, grad_output, out_dtype=weight.main_grad.dtype, layout="NT", '
           'out=weight.main_grad, grad=True)')


def main_grad_is_persistent(param: Any) -> bool:
    """Whether ``param.get_main_grad()`` returns Megatron-FSDP's persistent gradient buffer
    (the sum over the step's micro-batches: a wgrad must be added to it) rather than a bucket
    allocated for this backward and reduced before the next (not zeroed: it must be written).

    Megatron-FSDP (megatron-core 0.14-0.19, megatron-fsdp) sets ``param._gbuf``; its getter
    returns a view of the buffer's own storage exactly when ``not _gbuf.is_data_distributed``
    (``no_shard``/``optim``, or any strategy on one data-parallel rank). Without ``_gbuf`` it is
    not Megatron-FSDP's buffer: the overwrite of the replaced call stands.
    """
    # Instance attributes, read from __dict__: a tensor's getattr of a missing name raises
    # internally, which costs about a microsecond per call on this path.
    gbuf = getattr(param, "__dict__", {}).get("_gbuf")
    return gbuf is not None and not getattr(gbuf, "is_data_distributed", True)


def wgrad_accumulates(param: Any) -> bool:
    """Add rather than overwrite: the buffer persists, or this backward already wrote the
    weight's main_grad once (megatron sets ``grad_added_to_main_grad`` after each fused write;
    a weight used twice in one backward, a tied output layer under MTP, is written twice)."""
    if param is None:
        return False
    return main_grad_is_persistent(param) or bool(getattr(param, "__dict__", {}).get("grad_added_to_main_grad"))


_active_dispatcher = None  # dispatcher.active_dispatcher, bound on the first call (it imports torch)


def _dispatcher() -> Any:
    global _active_dispatcher
    if _active_dispatcher is None:
        from ..dispatcher import active_dispatcher

        _active_dispatcher = active_dispatcher
    return _active_dispatcher()


def fsdp_wgrad(a: Any, b: Any, *, out: Any, param: Any = None) -> Any:
    """Stands in for ``torch.matmul(grad_output.t(), total_input, out=weight.main_grad)``."""
    _dispatcher().gemm(a, b, out, accumulate=wgrad_accumulates(param))
    return out


def fsdp_wgrad_te(total_input: Any, grad_output: Any, *, out: Any, param: Any = None, **te_kwargs: Any) -> None:
    """Stands in for megatron-core 0.18+'s own ``te_general_gemm(...)`` on the Megatron-FSDP
    path (reached only where megatron found TE). Where it may overwrite, that very call runs,
    unchanged; where it must add, the product is added through the dispatcher instead."""
    if wgrad_accumulates(param):
        _dispatcher().gemm(grad_output.t(), total_input, out, accumulate=True)
        return
    from megatron.core.extensions.transformer_engine import te_general_gemm

    te_general_gemm(total_input, grad_output, out=out, **te_kwargs)


def _run_twin(twin: Any):
    function = twin.__func__ if isinstance(twin, (staticmethod, classmethod)) else twin

    def wrapper(wrapped, instance, args, kwargs):
        return function(*args, **kwargs)

    return wrapper


class PatchedCallSite(wrapt.FunctionWrapper):
    """The installed object: a wrapt FunctionWrapper around megatron's function (``__wrapped__``
    is it, so introspection sees megatron's name, doc and signature) whose calls run the twin."""

    def __init__(self, original: Any, twin: Any) -> None:
        super().__init__(original, _run_twin(twin))
        self._self_gemm_patch_twin = twin


@dataclass(frozen=True, kw_only=True, eq=False)
class CallSiteTarget(MethodTarget):
    """Send ``call`` (and each of ``also``, where present) inside ``owner.attribute`` to a
    replacement, in a twin of the method compiled from its own source."""

    call: str
    replacement: Any
    also: dict[str, Any]

    def inspect(self, module: types.ModuleType) -> Inspection:
        # "Not applicable" is settled from the source first: on a release without this call,
        # another target's twin of the same method is no reason to skip.
        found = find_call_site(module, self.owner, self.attribute, self.call)
        if not found.matches:
            return Inspection(found.fingerprint, False, f"no `{self.call}` in {self.where}")
        check_live_is_source(module, self.owner, self.attribute)
        return Inspection(found.fingerprint, True, self.where, found)

    def install(self, module: types.ModuleType, found: Inspection, undo: Undo) -> None:
        keywords = {"param": "weight"}
        redirects = [Redirect(found.payload.matches, "_gemm_patch_wgrad", self.replacement, keywords)]
        for i, (call, replacement) in enumerate(self.also.items()):
            matches = find_calls(found.payload.funcdef, call)
            if matches:
                redirects.append(Redirect(matches, f"_gemm_patch_also_{i}", replacement, keywords))
        twin = build_twin(found.payload, self.where, redirects)
        self.replace(module, undo, PatchedCallSite(self.live_object(module), twin))


TARGET = CallSiteTarget(
    name="fsdp-wgrad",
    distribution="megatron-core",
    module="megatron.core.tensor_parallel.layers",
    owner="LinearWithGradAccumulationAndAsyncCommunication",
    attribute="backward",
    relies_on="backward",
    call=CALL,
    replacement=fsdp_wgrad,
    also={TE_CALL: fsdp_wgrad_te},
    fingerprints={
        # 0.13.x has no such call: not applicable, nothing to record.
        "0.14.0": "7ec854ca9d6a137e",
        "0.15.0": "7ec854ca9d6a137e",
        "0.15.1": "7ec854ca9d6a137e",
        "0.15.2": "7ec854ca9d6a137e",
        "0.15.3": "7ec854ca9d6a137e",
        "0.16.0": "7ec854ca9d6a137e",
        "0.16.1": "7ec854ca9d6a137e",
        "0.17.0": "7ec854ca9d6a137e",
        "0.17.1": "7ec854ca9d6a137e",
        "0.18.0": "eeb4af4511d4b4e2",
        "0.18.2": "eeb4af4511d4b4e2",  # the torch.matmul left in the no-TE else-branch
        "0.19.0": "8052bd62d48b6d81",
        "0.19.2": "8052bd62d48b6d81",
    },
)
