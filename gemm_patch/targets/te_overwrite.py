"""GEMM_PATCH_TE_OVERWRITE: Transformer Engine's layers add their weight gradient to a persistent
Megatron-FSDP buffer instead of overwriting it, whoever set their ``overwrite_main_grad`` flag.

fsdp-te-overwrite / mfsdp-te-overwrite: undo Megatron-FSDP's ``param.overwrite_main_grad =
True`` where it is wrong.

Megatron-FSDP sets the flag on every parameter it unshards
(``MegatronFSDP.all_gather_and_wait_parameters_ready``); Transformer Engine's linear layers
read it in forward and then overwrite ``main_grad`` in backward instead of adding to it. Over a
persistent buffer (``no_shard``/``optim``, or any strategy on one data-parallel rank) that keeps
only the last micro-batch. The wrapper runs the method, then resets the flag of each such
parameter; parameters with fresh per-backward buckets keep True.

fsdp-te-overwrite-by-strategy / mfsdp-te-overwrite-by-strategy: Megatron-LM main's form of the
same statement (Megatron-LM PR #6357), ``param.overwrite_main_grad =
self.data_parallel_sharding_strategy in ["optim_grads", "optim_grads_params"]``: ``optim`` no
longer overwrites, but a sharded strategy on one data-parallel rank still does, over a buffer
that is not sharded and persists across micro-batches. Same wrapper. A release has one
statement or the other; the other target reads "not applicable".

moe-te-overwrite: megatron-core 0.19 (and main) can run the experts through TE's op fuser
(``TEGroupedMLP`` with ``use_transformer_engine_op_fuser``). The fused ops' pre-forward hook runs
each expert linear's own pre-forward hooks (Megatron-FSDP's unshard, after which the flag is
reset on persistent buffers), then the static ``TEGroupedMLP._ensure_main_grad(linear)``, which
sets ``overwrite_main_grad = True`` on every weight of the linear again. TE's ``GroupedLinear``
op reads it in backward, so over a persistent buffer each expert would keep only the last
micro-batch's gradient. The wrapper runs the static method, then resets the flag the same way.
One switch for the three: with one of them off the others alone would leave a mix of upstream
and patched behaviour on the same weights.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import wrapt

from ..engine.callsite import check_live_is_source, find_statement
from ..engine.config import Config
from ..engine.target import DEFAULTS, Inspection, MethodTarget, Undo, in_both_fsdp_packages
from ..upstream.fsdp_rules import main_grad_is_persistent

STATEMENT = "param.overwrite_main_grad = True"


def _params_argument(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """The ``params`` argument (first after self), as a list where it was a one-shot iterator
    (the original walks it, and so does the reset)."""
    if args:
        params, rest = args[0], args[1:]
        if iter(params) is params:
            params = list(params)
        return params, (params, *rest), kwargs
    params = kwargs.get("params", ())
    if iter(params) is params:
        params = list(params)
        kwargs = {**kwargs, "params": params}
    return params, args, kwargs


class PatchedOverwriteFlag(wrapt.FunctionWrapper):
    """A wrapt FunctionWrapper around the original method (``__wrapped__``); ``resets`` counts
    the flags it has reset."""

    def __init__(self, original: Any) -> None:
        super().__init__(original, self._reset_after)
        self._self_resets = 0

    @property
    def resets(self) -> int:
        return self._self_resets

    def _params(self, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
        """The parameters whose flag the call may set, and the arguments to call it with."""
        return _params_argument(args, kwargs)

    def _reset_after(self, wrapped, instance, args, kwargs):
        params, args, kwargs = self._params(args, kwargs)
        result = wrapped(*args, **kwargs)
        resets = 0
        for param in params:
            if getattr(param, "overwrite_main_grad", False) and main_grad_is_persistent(param):
                param.overwrite_main_grad = False
                resets += 1
        # One update of the wrapper's counter per call: each costs about 1 us through wrapt's proxy.
        self._self_resets += resets
        return result


@dataclass(frozen=True, kw_only=True, eq=False)
class OverwriteFlagTarget(MethodTarget):
    statement: str = STATEMENT

    def inspect(self, module: types.ModuleType, cfg: Config = DEFAULTS) -> Inspection:
        found = find_statement(module, self.owner, self.attribute, self.statement)
        if found is None or self.live_object(module) is None:
            return Inspection(None, False, f"{module.__name__} has no {self.where}")
        if not found.matches:
            return Inspection(found.fingerprint, False, f"no `{self.statement}` in {self.where}")
        check_live_is_source(module, self.owner, self.attribute)
        return Inspection(found.fingerprint, True, self.where, found)

    def install(self, module: types.ModuleType, found: Inspection, undo: Undo, cfg: Config) -> str | None:
        self.replace(module, undo, self.wrapper(self.live_object(module)))

    @property
    def wrapper(self) -> type[PatchedOverwriteFlag]:
        return PatchedOverwriteFlag


SWITCH = "GEMM_PATCH_TE_OVERWRITE"  # one switch for every place that sets the flag
_UNSHARD = dict(switch=SWITCH, owner="MegatronFSDP", attribute="all_gather_and_wait_parameters_ready")

TARGET, STANDALONE = in_both_fsdp_packages(OverwriteFlagTarget, "fsdp-te-overwrite", "megatron_fsdp",
                                           relies_on=f"`{STATEMENT}` method", **_UNSHARD)


BY_STRATEGY = ('param.overwrite_main_grad = self.data_parallel_sharding_strategy in '
               '["optim_grads", "optim_grads_params"]')
_BY_STRATEGY_COMMON = dict(
    relies_on="`param.overwrite_main_grad = <strategy is optim_grads(_params)>` method",
    statement=BY_STRATEGY,
    **_UNSHARD,
)

BY_STRATEGY_TARGET, BY_STRATEGY_STANDALONE = in_both_fsdp_packages(
    OverwriteFlagTarget, "fsdp-te-overwrite-by-strategy", "megatron_fsdp", **_BY_STRATEGY_COMMON)


class PatchedExpertFlag(PatchedOverwriteFlag):
    """``PatchedOverwriteFlag`` for the static method taking the expert linear module
    (``__wrapped__`` is the ``staticmethod`` object)."""

    def _params(self, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
        linear = args[0] if args else kwargs.get("linear_module")
        # The original sets nothing where fusion is off; neither does the reset.
        if linear is None or not getattr(linear, "fuse_wgrad_accumulation", False):
            return (), args, kwargs
        return list(linear.parameters(recurse=False)), args, kwargs


@dataclass(frozen=True, kw_only=True, eq=False)
class ExpertFlagTarget(OverwriteFlagTarget):
    """The same inspection, with the wrapper for a static method taking the linear module."""

    @property
    def wrapper(self) -> type[PatchedOverwriteFlag]:
        return PatchedExpertFlag


MOE_TARGET = ExpertFlagTarget(
    name="moe-te-overwrite",
    distribution="megatron-core",
    module="megatron.core.transformer.moe.experts",
    switch=SWITCH,
    relies_on=f"`{STATEMENT}` method",
    owner="TEGroupedMLP",
    attribute="_ensure_main_grad",
    statement=STATEMENT,
)
