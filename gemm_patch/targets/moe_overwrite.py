"""moe-te-overwrite: undo the ``param.overwrite_main_grad = True`` that megatron-core's fused
grouped MLP puts back on expert weights before every forward, where it is wrong.

megatron-core 0.19 (and main) can run the experts through Transformer Engine's op fuser
(``TEGroupedMLP`` with ``use_transformer_engine_op_fuser``). The fused ops' pre-forward hook
first runs each expert linear's own pre-forward hooks (Megatron-FSDP's unshard, after which
fsdp-te-overwrite has reset the flag on persistent buffers), then
``TEGroupedMLP._ensure_main_grad(linear_fc1)`` and ``(linear_fc2)``, a static method that sets
``overwrite_main_grad = True`` on every weight of the linear that has the attribute. TE's
``GroupedLinear`` op reads it in backward (``get_accumulate_flag_in_param``: overwrite when
True), so over a persistent Megatron-FSDP buffer (``optim``, or any sharded strategy on one
data-parallel rank) each expert keeps only the last micro-batch's gradient.

The wrapper runs the static method, then resets the flag of each weight of that linear module
whose ``main_grad`` is the persistent buffer (``fsdp_wgrad.main_grad_is_persistent``), as
fsdp-te-overwrite does for dense layers; weights with fresh per-backward buckets keep True.
It shares fsdp-te-overwrite's switch, GEMM_PATCH_TE_OVERWRITE: one fix (the flag) in the two
places that set it, and with one of them off the other alone would leave a mix of upstream and
patched behaviour on the same expert weights.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from .base import Inspection, Undo
from .te_overwrite import OverwriteFlagTarget, PatchedOverwriteFlag

STATEMENT = "param.overwrite_main_grad = True"
# Megatron-LM main (0.20.0, unreleased), pinned; its _ensure_main_grad is 0.19's.
MAIN_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


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
    """``OverwriteFlagTarget``'s inspection (the statement in the method, the live object is
    the file's), with a wrapper for a static method taking the linear module."""

    def install(self, module: types.ModuleType, found: Inspection, undo: Undo, cfg: Any) -> str | None:
        self.replace(module, undo, PatchedExpertFlag(self.live_object(module)))


TARGET = ExpertFlagTarget(
    name="moe-te-overwrite",
    distribution="megatron-core",
    module="megatron.core.transformer.moe.experts",
    switch="GEMM_PATCH_TE_OVERWRITE",
    relies_on=f"`{STATEMENT}` method",
    owner="TEGroupedMLP",
    attribute="_ensure_main_grad",
    statement=STATEMENT,
    fingerprints={
        # 0.13.x-0.18.x: no TEGroupedMLP._ensure_main_grad (not applicable).
        "0.19.0": "85079750849ec616",
        "0.19.2": "85079750849ec616",
        # Megatron-LM main (megatron-core reports "0.20.0", the version 0.20.0 will report):
        # keyed by the pinned commit, not by a release that does not exist yet.
        f"main@{MAIN_COMMIT[:8]}": "85079750849ec616",  # = 0.19.2
    },
)
