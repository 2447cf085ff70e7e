"""fsdp-wgrad: megatron-core's ``torch.matmul(grad_output.t(), total_input, out=weight.main_grad)``
in ``LinearWithGradAccumulationAndAsyncCommunication.backward`` (the Megatron-FSDP branch of
gradient-accumulation fusion), sent to the WgradDispatcher.

``torch.matmul`` cannot write a bf16 product into an fp32 main_grad; the dispatcher can. It
also decides, per call, whether to overwrite or add (``wgrad_accumulates``).

Its optional part (``GEMM_PATCH_FSDP_DUMMY_GRAD``, on by default): after the fused write megatron
returns a dummy ``grad_weight`` of the weight's full shape, only so that autograd runs the
gradient hooks. With TE it is TE's ``get_dummy_wgrad``, cached per shape for the whole process:
the output layer's alone is 1 GiB of bf16 at vocabulary 128256 x hidden 4096, held for good (and
``torch.empty`` without TE allocates it on every backward). The twin returns instead a bf16 view
of the first bytes of the weight's own ``main_grad``, which is the same shape and dtype and costs
nothing, wherever that is safe (``main_grad_alias``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import wrapt

from ..callsite import (
    Redirect,
    build_twin,
    check_live_is_source,
    find_assigned_calls,
    find_call_site,
    find_calls,
)
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


DUMMY_SWITCH = "GEMM_PATCH_FSDP_DUMMY_GRAD"
TE_DUMMY = "get_dummy_wgrad(list(weight.main_grad.shape), input.dtype)"
EMPTY_DUMMY = ("torch.empty(weight.main_grad.shape, dtype=input.dtype, device=torch.cuda.current_device(), "
               "requires_grad=False)")
# Marks a weight megatron or Megatron-FSDP treats as used more than once: its .grad is added to
# or kept (zero_out_wgrad, the hook skipping _is_shared), so it must not alias main_grad.
_SHARED_MARKS = ("_is_shared", "shared", "shared_embedding", "zero_out_wgrad")


def view_forbidden(tensor: Any) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``tensor``'s device, or
    autograd's anomaly mode is on (it checks returned gradients for NaN: the view shows
    main_grad's bits as bf16, and the low half of an fp32 number can read as NaN)."""
    import torch

    return (tensor.is_cuda and torch.cuda.is_current_stream_capturing()) or torch.is_anomaly_enabled()


def main_grad_alias(param: Any, shape: Any, dtype: Any) -> Any:
    """A ``dtype`` tensor of ``shape`` over the first bytes of ``param.main_grad``, or None.

    The dummy's values are never read: autograd stores it as ``param.grad`` (a stolen reference,
    no copy) and Megatron-FSDP's post-accumulate-grad hook (``_grad_acc``) deletes it at once
    because ``grad_added_to_main_grad`` is set. Only a write to ``param.grad`` could reach
    main_grad through the view, so it is given only where nothing writes there: a Megatron-FSDP
    parameter (``_gbuf``) that carries no mark of a second use, with no ``.grad`` pending from an
    earlier use, outside CUDA-graph capture (where megatron's own dummy keeps its fixed address),
    outside anomaly mode, over a contiguous main_grad on the same device that holds at least as many bytes."""
    attrs = getattr(param, "__dict__", {})
    main_grad = attrs.get("main_grad")
    if attrs.get("_gbuf") is None or main_grad is None or any(attrs.get(m) for m in _SHARED_MARKS):
        return None
    import torch

    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if (param.grad is not None or not main_grad.is_contiguous() or main_grad.device != param.device
            or main_grad.numel() * main_grad.element_size() < nbytes or view_forbidden(main_grad)):
        return None
    return main_grad.view(-1).view(torch.uint8)[:nbytes].view(dtype).view(shape)


def fsdp_dummy_wgrad_te(shape: Any, dtype: Any, *, param: Any = None) -> Any:
    """Stands in for ``get_dummy_wgrad(list(weight.main_grad.shape), input.dtype)``."""
    alias = main_grad_alias(param, shape, dtype)
    if alias is not None:
        return alias
    import sys

    # TE's own function, looked up as the original call would: in megatron's module, now.
    return sys.modules["megatron.core.tensor_parallel.layers"].get_dummy_wgrad(shape, dtype)


def fsdp_dummy_wgrad_empty(shape: Any, *, dtype: Any, param: Any = None, **kwargs: Any) -> Any:
    """Stands in for megatron's ``torch.empty(weight.main_grad.shape, dtype=input.dtype, ...)``
    dummy (no TE)."""
    alias = main_grad_alias(param, shape, dtype)
    if alias is not None:
        return alias
    import torch

    return torch.empty(shape, dtype=dtype, **kwargs)


DUMMY_CALLS = {TE_DUMMY: fsdp_dummy_wgrad_te, EMPTY_DUMMY: fsdp_dummy_wgrad_empty}


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
    # Assigned calls sent to a stand-in when ``dummy_switch`` is on (the dummy grad_weight).
    dummies: dict[str, Any] = field(default_factory=dict)
    dummy_switch: str = DUMMY_SWITCH

    @property
    def options(self) -> dict[str, bool]:
        return {self.dummy_switch: True} if self.dummies else {}

    def inspect(self, module: types.ModuleType) -> Inspection:
        # "Not applicable" is settled from the source first: on a release without this call,
        # another target's twin of the same method is no reason to skip.
        found = find_call_site(module, self.owner, self.attribute, self.call)
        if not found.matches:
            return Inspection(found.fingerprint, False, f"no `{self.call}` in {self.where}")
        check_live_is_source(module, self.owner, self.attribute)
        return Inspection(found.fingerprint, True, self.where, found)

    def install(self, module: types.ModuleType, found: Inspection, undo: Undo, cfg: Any) -> str | None:
        keywords = {"param": "weight"}
        redirects = [Redirect(found.payload.matches, "_gemm_patch_wgrad", self.replacement, keywords)]
        for i, (call, replacement) in enumerate(self.also.items()):
            matches = find_calls(found.payload.funcdef, call)
            if matches:
                redirects.append(Redirect(matches, f"_gemm_patch_also_{i}", replacement, keywords))
        note = None
        if self.dummies:
            aliased = cfg is None or cfg.switch_on(self.dummy_switch, True)
            for i, (call, replacement) in enumerate(self.dummies.items() if aliased else ()):
                matches = find_assigned_calls(found.payload.funcdef, call)
                if matches:
                    redirects.append(Redirect(matches, f"_gemm_patch_dummy_{i}", replacement, keywords))
            note = ("dummy grad_weight: a view of main_grad" if aliased
                    else f"dummy grad_weight: megatron's ({self.dummy_switch}=0)")
        twin = build_twin(found.payload, self.where, redirects)
        self.replace(module, undo, PatchedCallSite(self.live_object(module), twin))
        return note


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
    dummies=DUMMY_CALLS,
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
