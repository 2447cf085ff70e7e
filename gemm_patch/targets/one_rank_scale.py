"""fsdp-one-rank-scale / mfsdp-one-rank-scale: Megatron-FSDP scales a gradient bucket itself
where its reduce runs over a one-rank group, instead of leaving the factor to NCCL.

Megatron-FSDP averages gradients by a factor per buffer (``gradient_scaling_factor``: 1/dp for
dense weights, ``expert_gradient_scaling_factor`` for experts). With
``gradient_reduce_div_fusion`` on (the default) and a non-bf16 buffer,
``gradient_reduce_preprocessing`` hands the factor to the collective as a PreMulSum op, and
NCCL's ``reduce_scatter_tensor`` over a one-rank group ignores that factor, in place or not,
while ``all_reduce`` applies it (NCCL 2.28.9). Expert parallelism makes such groups with a
factor other than 1: EP = DP = 2 gives experts a one-rank data-parallel group and a factor of
0.5, and every sharded strategy reduce-scatters, so each expert gradient comes out 2x, fusion
on or off.

Each reduce applies the factor to the bucket as it stands, and a buffer on a one-rank group is
not sharded: it keeps the sum of the step's micro-batches, so with ``optim_grads``/
``optim_grads_params`` (a reduce after every backward) scaling at each reduce would compound
(s^4 g1 + s^3 g2 + ...). The patch therefore records each ``DataParallelBuffer`` built over a
one-rank group with a factor other than None or 1; for a gradient in one of those buffers
``gradient_reduce_preprocessing`` returns a plain SUM (a one-rank reduce leaves the data as it
is, whatever NCCL does with factors) and marks the buffer; ``ParamAndGradBuffer.update_main_grads``
(once per step, from ``finish_grad_sync``, before the optimizer sees the gradients) first
multiplies each marked buffer by its factor once. Every other buffer keeps megatron's op, and
``average_in_collective`` (megatron's AVG instead of the factor) is left as it is. A
communication copy in another dtype (``grad_comm_dtype``) is not the buffer's memory and is left
as upstream has it.

A buffer built before the patch (a model built before ``apply()``) did not pass through the
wrapped ``__init__``: ``apply()`` finds those buffers (``Target.built_classes``) and records each
by the same rule, from the settings its ``__init__`` stored.
"""

from __future__ import annotations

import ast
import importlib
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import wrapt

from ..engine.callsite import (
    CallSiteError,
    check_live_function_is_source,
    check_live_is_source,
    code_fingerprint,
    fingerprint,
    parse_method,
)
from ..engine.config import Config
from ..engine.target import DEFAULTS, Inspection, MethodTarget, Target, Undo, in_both_fsdp_packages

FUNCTION = "gradient_reduce_preprocessing"
PREMUL = "torch.distributed._make_nccl_premul_sum"
BUFFERS = "ParamAndGradBuffer"
UPDATE = "update_main_grads"


def _reduce_arguments(grad_data: Any, scaling_factor: Any, ddp_config: Any) -> tuple[Any, Any, Any]:
    """``gradient_reduce_preprocessing``'s arguments, however they were passed."""
    return grad_data, scaling_factor, ddp_config


class OneRankBuffers:
    """The buffers over one-rank groups that carry a factor (weakly held), those holding
    gradients not yet scaled, and the three wrappers that keep both sets."""

    def __init__(self) -> None:
        self.buffers: weakref.WeakSet = weakref.WeakSet()
        self.pending: weakref.WeakSet = weakref.WeakSet()

    def record_after_init(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        self.record(instance)
        return result

    def record(self, buffer: Any) -> None:
        """Record ``buffer`` where it is over a one-rank group with a factor. It reads only what
        ``__init__`` stored, so a buffer built before the patch is recorded as one built after."""
        factor = getattr(buffer, "gradient_scaling_factor", None)
        if getattr(buffer, "dp_world_size", None) == 1 and factor is not None and factor != 1:
            self.buffers.add(buffer)

    def owner_of(self, grad_data: Any) -> Any:
        """The recorded buffer whose data holds all of ``grad_data`` (by address: buffers may be
        slices of one allocation, ``buffer_all_in_one``), or None."""
        start = grad_data.data_ptr()
        end = start + grad_data.numel() * grad_data.element_size()
        for buffer in list(self.buffers):
            data = getattr(buffer, "data", None)
            if data is not None and data.device == grad_data.device and \
                    data.data_ptr() <= start and end <= data.data_ptr() + data.numel() * data.element_size():
                return buffer
        return None

    def preprocess(self, wrapped, instance, args, kwargs):
        grad_data, factor, config = _reduce_arguments(*args, **kwargs)
        buffer = self.owner_of(grad_data) if self.buffers and grad_data is not None else None
        if buffer is None or factor is None or getattr(config, "average_in_collective", False):
            return wrapped(*args, **kwargs)
        import torch

        self.pending.add(buffer)
        return torch.distributed.ReduceOp.SUM

    def scale_before_update(self, wrapped, instance, args, kwargs):
        # Only this ParamAndGradBuffer's own buffers: another model chunk's may still be reduced.
        owner = instance if instance is not None else (args[0] if args else None)  # called via the class
        own = {id(g.main_grad_buffer) for g in getattr(owner, "parameter_groups", ())
               if getattr(g, "main_grad_buffer", None) is not None}
        for buffer in [b for b in self.pending if id(b) in own]:
            buffer.data.mul_(buffer.gradient_scaling_factor)
            self.pending.discard(buffer)
        return wrapped(*args, **kwargs)


@dataclass(frozen=True, kw_only=True, eq=False)
class OneRankScaleTarget(MethodTarget):
    """Fingerprints the three functions it wraps, all in ``buffers_module``:
    ``DataParallelBuffer.__init__`` (where the group size and the factor are stored),
    ``gradient_reduce_preprocessing`` (its PreMulSum branch) and
    ``ParamAndGradBuffer.update_main_grads``. It is triggered by Megatron-FSDP's main module,
    which imports ``buffers_module``, so that it settles with the other Megatron-FSDP targets."""

    buffers_module: str
    # One record per target, whichever install's wrappers run: a buffer recorded before apply()
    # patched again (a reload of the buffers module) is still scaled.
    buffers: OneRankBuffers = field(default_factory=lambda: OneRankBuffers(), init=False, repr=False)

    def _pgb(self) -> types.ModuleType:
        return sys.modules.get(self.buffers_module) or importlib.import_module(self.buffers_module)

    def home(self, module: types.ModuleType) -> types.ModuleType:
        return self._pgb()

    def inspect(self, module: types.ModuleType, cfg: Config = DEFAULTS) -> Inspection:
        pgb = self._pgb()
        update_owner = vars(pgb).get(BUFFERS)
        if (not callable(vars(pgb).get(FUNCTION)) or self.live_object(pgb) is None
                or not isinstance(update_owner, type) or UPDATE not in vars(update_owner)):
            return Inspection(None, False, f"{pgb.__name__} has no {FUNCTION}, {self.where} and {BUFFERS}.{UPDATE}")
        function = check_live_function_is_source(pgb, FUNCTION)
        init, update = parse_method(pgb, self.owner, self.attribute), parse_method(pgb, BUFFERS, UPDATE)
        if init is None or update is None:
            raise CallSiteError(f"{self.where} or {BUFFERS}.{UPDATE} is not in {pgb.__name__}'s file")
        found, code = fingerprint(function, init, update), code_fingerprint(function, init, update)
        if PREMUL not in ast.unparse(function):
            return Inspection(found, False, f"no `{PREMUL}` in {FUNCTION}", code_fingerprint=code)
        check_live_is_source(pgb, self.owner, self.attribute)
        check_live_is_source(pgb, BUFFERS, UPDATE)
        return Inspection(found, True, "the reduce of buffers on one-rank groups", code_fingerprint=code)

    def install(self, module: types.ModuleType, found: Inspection, undo: Undo, cfg: Config) -> str | None:
        pgb, buffers = self._pgb(), self.buffers
        self.replace(pgb, undo, wrapt.FunctionWrapper(self.live_object(pgb), buffers.record_after_init))
        for owner, name, wrapper in ((pgb, FUNCTION, buffers.preprocess),
                                     (vars(pgb)[BUFFERS], UPDATE, buffers.scale_before_update)):
            wrapped = wrapt.FunctionWrapper(vars(owner)[name], wrapper)
            wrapped._self_gemm_patch_target = self.name
            undo.set(owner, name, wrapped)
        return None

    def in_place(self, module: types.ModuleType, undo: Undo) -> str | None:
        return Target.in_place(self, module, undo)

    def runs_patched(self, instance: Any, undo: Undo) -> bool:
        self.buffers.record(instance)  # a buffer built before apply(): its settings read now
        return True


_COMMON = dict(
    switch="GEMM_PATCH_ONE_RANK_SCALE",
    relies_on=f"{FUNCTION}, DataParallelBuffer.__init__ and {BUFFERS}.{UPDATE}",
    owner="DataParallelBuffer",
    attribute="__init__",
    runs_at_build=True,
)

TARGET, STANDALONE = in_both_fsdp_packages(OneRankScaleTarget, "fsdp-one-rank-scale", "megatron_fsdp",
                                           buffers_module="{package}.param_and_grad_buffer", **_COMMON)
