"""GEMM_PATCH_FSDP_WGRAD: the Megatron-FSDP branch of gradient-accumulation fusion writes its
weight gradient through the WgradDispatcher, adding where it must.

fsdp-wgrad: megatron-core's ``torch.matmul(grad_output.t(), total_input, out=weight.main_grad)``
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

fsdp-wgrad-gemm: Megatron-LM main's ``_wgrad_gemm(weight.main_grad, grad_output, total_input)`` in
the same branch (Megatron-LM PR #6624 replaced the ``torch.matmul``): TE's GEMM into ``out``
without accumulation, or ``out.copy_(grad_output.t().matmul(total_input))`` without TE. Either
overwrites: right for a bucket allocated for this backward, wrong for Megatron-FSDP's persistent
buffer and for a weight written twice in one backward (``wgrad_accumulates``). There the product
is added through the dispatcher; everywhere else megatron's own ``_wgrad_gemm`` runs, unchanged.
The other ``_wgrad_gemm`` call of that backward (GTP's sharded wgrad tensor) is not touched. A
release has one form or the other; the other target reads "not applicable".
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

from ..engine.callsite import (
    Redirect,
    build_twin,
    check_live_is_source,
    find_assigned_calls,
    find_call_site,
    find_calls,
)
from ..engine.config import Config
from ..engine.target import DEFAULTS, Inspection, MethodTarget, PatchedTwin, Undo
from ..upstream import fsdp_rules
from ..upstream.fsdp_rules import is_fsdp_param, main_grad_alias, wgrad_accumulates

LAYERS = "megatron.core.tensor_parallel.layers"
CALL = "torch.matmul(grad_output.t(), total_input, out=weight.main_grad)"
# 0.18+: megatron's own TE call beside it overwrites too; routed so it adds where it must.
TE_CALL = ('te_general_gemm(total_input, grad_output, out_dtype=weight.main_grad.dtype, layout="NT", '
           'out=weight.main_grad, grad=True)')


_active_dispatcher = None  # gemm.active.active_dispatcher, bound on the first call


def _dispatcher() -> Any:
    global _active_dispatcher
    if _active_dispatcher is None:
        from ..gemm.active import active_dispatcher

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
def fsdp_dummy_wgrad_te(shape: Any, dtype: Any, *, param: Any = None) -> Any:
    """Stands in for ``get_dummy_wgrad(list(weight.main_grad.shape), input.dtype)``."""
    alias = main_grad_alias(param, shape, dtype)
    if alias is not None:
        return alias
    # TE's own function, looked up as the original call would: in megatron's module, now.
    return sys.modules[LAYERS].get_dummy_wgrad(shape, dtype)


def fsdp_dummy_wgrad_empty(shape: Any, *, dtype: Any, param: Any = None, **kwargs: Any) -> Any:
    """Stands in for megatron's ``torch.empty(weight.main_grad.shape, dtype=input.dtype, ...)``
    dummy (no TE)."""
    alias = main_grad_alias(param, shape, dtype)
    return alias if alias is not None else megatrons_own("empty", shape, dtype, kwargs)


def megatrons_own(factory: str, shape: Any, dtype: Any, kwargs: dict[str, Any]) -> Any:
    """The dummy megatron's own call makes (``torch.empty`` or ``torch.zeros``)."""
    import torch

    return getattr(torch, factory)(shape, dtype=dtype, **kwargs)


# A weight megatron marks ``zero_out_wgrad`` (the tied embedding/output weight) gets a zeros dummy.
ZERO_TE_DUMMY = "get_dummy_wgrad(list(weight.main_grad.shape), input.dtype, zero=True)"
ZERO_DUMMY = ("torch.zeros(weight.main_grad.shape, dtype=input.dtype, device=torch.cuda.current_device(), "
              "requires_grad=False)")


def broadcast_zero(param: Any, shape: Any, dtype: Any) -> Any:
    """Zeros of ``shape`` and ``dtype`` on ``param``'s device, one element broadcast (stride 0),
    for a Megatron-FSDP parameter outside CUDA-graph capture and anomaly mode; else None.

    The zeros dummy of a ``zero_out_wgrad`` weight is read, never written: autograd sums it with
    the weight's other gradients (the embedding lookup's), adding into the other, dense operand
    or into a new tensor (its input buffer adds in place only into a dense tensor whose storage
    it holds alone), and gives ``param.grad`` a dense copy where the dummy arrives alone (a
    gradient that does not match the weight's strides is cloned). Megatron-FSDP's ``_grad_acc``
    then reads ``param.grad``. Every sum has the same bits as with megatron's full zeros (x + 0,
    element by element), and nothing persists: TE's ``get_dummy_wgrad(..., zero=True)`` keeps a
    full tensor per shape for the process (1 GiB for a 128256 x 4096 output layer) and zero-fills
    it every backward. A write into the broadcast tensor would raise, not go astray: a weight
    with tensor hooks, which may write into the gradient they are handed, gets megatron's own
    zeros, and so does a backward that hands the weight's gradient to its caller
    (``torch.autograd.grad``), who may write into it. During capture megatron's own call runs (a
    graph replays fixed addresses), and under anomaly mode, as for the view."""
    if (not is_fsdp_param(param) or fsdp_rules.has_tensor_hooks(param) or fsdp_rules.view_forbidden(param)
            or not fsdp_rules.accumulates_into_grad(param)):
        return None
    import torch

    zeros = torch.zeros((), dtype=dtype, device=param.device).expand(shape)
    # Where this dummy alone reaches the weight's gradient (the other uses wrote into main_grad
    # themselves: fsdp-embedding-wgrad, whose lookup puts the hook on the weight that recognises
    # it), there is nothing to add.
    if fsdp_rules.takes_direct_writes(param):
        fsdp_rules.register_zero_dummy(param, zeros)
    return zeros


def fsdp_zero_dummy_wgrad_te(shape: Any, dtype: Any, zero: bool = False, *, param: Any = None) -> Any:
    """Stands in for ``get_dummy_wgrad(list(weight.main_grad.shape), input.dtype, zero=True)``."""
    zeros = broadcast_zero(param, shape, dtype) if zero else None
    return zeros if zeros is not None else sys.modules[LAYERS].get_dummy_wgrad(shape, dtype, zero=zero)


def fsdp_zero_dummy_wgrad(shape: Any, *, dtype: Any, param: Any = None, **kwargs: Any) -> Any:
    """Stands in for megatron's ``torch.zeros(weight.main_grad.shape, dtype=input.dtype, ...)``
    dummy (no TE)."""
    zeros = broadcast_zero(param, shape, dtype)
    return zeros if zeros is not None else megatrons_own("zeros", shape, dtype, kwargs)


DUMMY_CALLS = {TE_DUMMY: fsdp_dummy_wgrad_te, EMPTY_DUMMY: fsdp_dummy_wgrad_empty,
               ZERO_TE_DUMMY: fsdp_zero_dummy_wgrad_te, ZERO_DUMMY: fsdp_zero_dummy_wgrad}


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

    def inspect(self, module: types.ModuleType, cfg: Config = DEFAULTS) -> Inspection:
        # "Not applicable" is settled from the source first: on a release without this call,
        # another target's twin of the same method is no reason to skip.
        found = find_call_site(module, self.owner, self.attribute, self.call)
        if not found.matches:
            return Inspection(found.fingerprint, False, f"no `{self.call}` in {self.where}")
        check_live_is_source(module, self.owner, self.attribute)
        return Inspection(found.fingerprint, True, self.where, found)

    def install(self, module: types.ModuleType, found: Inspection, undo: Undo, cfg: Config) -> str | None:
        keywords = {"param": "weight"}
        redirects = [Redirect(found.payload.matches, "_gemm_patch_wgrad", self.replacement, keywords)]
        for i, (call, replacement) in enumerate(self.also.items()):
            matches = find_calls(found.payload.funcdef, call)
            if matches:
                redirects.append(Redirect(matches, f"_gemm_patch_also_{i}", replacement, keywords))
        note = None
        if self.dummies:
            aliased = cfg.switch_on(self.dummy_switch, True)
            for i, (call, replacement) in enumerate(self.dummies.items() if aliased else ()):
                matches = find_assigned_calls(found.payload.funcdef, call)
                if matches:
                    redirects.append(Redirect(matches, f"_gemm_patch_dummy_{i}", replacement, keywords))
            note = ("dummy grad_weight: a view of main_grad" if aliased
                    else f"dummy grad_weight: megatron's ({self.dummy_switch}=0)")
        twin = build_twin(found.payload, self.where, redirects)
        self.replace(module, undo, PatchedTwin(self.live_object(module), twin))
        return note


# What both forms of the fix share: megatron-core's backward of the fused linear, one switch.
_BACKWARD = dict(
    distribution="megatron-core",
    module=LAYERS,
    switch="GEMM_PATCH_FSDP_WGRAD",
    owner="LinearWithGradAccumulationAndAsyncCommunication",
    attribute="backward",
    relies_on="backward",
    dummies=DUMMY_CALLS,
)

TARGET = CallSiteTarget(
    name="fsdp-wgrad",
    call=CALL,
    replacement=fsdp_wgrad,
    also={TE_CALL: fsdp_wgrad_te},
    **_BACKWARD,
)


GEMM_CALL = "_wgrad_gemm(weight.main_grad, grad_output, total_input)"


def fsdp_wgrad_gemm(out: Any, grad_output: Any, total_input: Any, *, param: Any = None) -> Any:
    """Stands in for ``_wgrad_gemm(weight.main_grad, grad_output, total_input)``."""
    if wgrad_accumulates(param):
        _dispatcher().gemm(grad_output.t(), total_input, out, accumulate=True)
        return out
    # Megatron's own function, looked up as the original call would: in the module, now.
    return sys.modules[LAYERS]._wgrad_gemm(out, grad_output, total_input)


GEMM_TARGET = CallSiteTarget(
    name="fsdp-wgrad-gemm",
    call=GEMM_CALL,
    replacement=fsdp_wgrad_gemm,
    also={},
    **_BACKWARD,
)
