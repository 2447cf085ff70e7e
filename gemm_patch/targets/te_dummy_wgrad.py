"""te-dummy-wgrad: Transformer Engine's ``Linear`` and ``LayerNormLinear`` allocate the dummy
weight gradient they return after a fused write into ``main_grad`` per call, instead of taking
it from TE's process-wide cache.

With ``fuse_wgrad_accumulation`` the weight gradient goes straight into ``main_grad`` and TE's
backward still returns a tensor of the weight's shape, only so that autograd runs the gradient
hooks. ``get_dummy_wgrad`` (``transformer_engine.pytorch.module.base``) keeps one per (shape,
dtype) for the life of the process: at hidden 4096 / FFN 16384 the QKV, FC1, projection and FC2
shapes hold 0.375 GiB for good, and that memory sits at the training peak, which fusion off does
not have. Megatron-FSDP's hook drops the dummy as soon as autograd stored it, so a tensor
allocated per call lives as long as fusion off's real bf16 wgrad does, and the fused peak equals
fusion off's.

The two modules' ``get_dummy_wgrad`` global is replaced; TE's own function, the cache, and every
other caller are left as they are: ``GroupedLinear`` and the op fuser return one dummy per expert
in one call, where the shared cached tensor is cheaper than one per expert. During CUDA-graph
capture the cached tensor is returned (a graph replays fixed addresses). The values are the same
as TE's: uninitialised, or zeros where TE asks for zeros.
"""

from __future__ import annotations

import ast
import functools
import sys
import types
from dataclasses import dataclass
from typing import Any

from ..engine.callsite import CallSiteError, canonical_dump, check_live_function_is_source, fingerprint, read_module
from ..engine.config import Config
from ..engine.target import DEFAULTS, Inspection, Target, Undo

BASE = "transformer_engine.pytorch.module.base"
CALLERS = ("transformer_engine.pytorch.module.linear", "transformer_engine.pytorch.module.layernorm_linear")
NAME = "get_dummy_wgrad"
DEVICE = "cuda"  # TE's own choice (the current CUDA device); tests on the CPU set "cpu"


def per_call_dummy(cached: Any) -> Any:
    """A ``get_dummy_wgrad`` that allocates per call, except during CUDA-graph capture."""

    @functools.wraps(cached)
    def get_dummy_wgrad(shape: list, dtype: Any, zero: bool = False) -> Any:
        import torch

        if DEVICE == "cuda" and torch.cuda.is_current_stream_capturing():
            return cached(shape, dtype, zero=zero)
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=DEVICE, requires_grad=False)

    get_dummy_wgrad._gemm_patch_target = "te-dummy-wgrad"
    return get_dummy_wgrad


def _calls(tree: ast.Module) -> tuple[ast.stmt, ...]:
    """Every assignment whose value is a call of ``get_dummy_wgrad`` (by name)."""
    return tuple(node for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                 and isinstance(node.value.func, ast.Name) and node.value.func.id == NAME)


@dataclass(frozen=True, kw_only=True, eq=False)
class DummyWgradTarget(Target):
    def inspect(self, module: types.ModuleType, cfg: Config = DEFAULTS) -> Inspection:
        base = sys.modules.get(BASE)
        callers = [sys.modules.get(name) for name in CALLERS]
        if base is None or NAME not in vars(base) or not any(callers):
            return Inspection(None, False, f"no {BASE}.{NAME} and callers")
        funcdef = check_live_function_is_source(base, NAME)
        found, calls = [], []
        for caller in filter(None, callers):
            statements = read_module(caller, "dummy_wgrad_calls", None, _calls)
            if not statements:
                continue
            if vars(caller).get(NAME) is not vars(base)[NAME]:
                raise CallSiteError(f"{caller.__name__}.{NAME} is not {BASE}.{NAME} (replaced by someone else)")
            found.append(caller)
            calls += sorted(canonical_dump(s) for s in statements)
        if not found:  # the function is there, no caller calls it by name: judged by the function alone
            return Inspection(fingerprint(funcdef), False, f"no call of {NAME} in {', '.join(CALLERS)}")
        where = f"{NAME} in {', '.join(c.__name__.rsplit('.', 1)[1] for c in found)}"
        return Inspection(fingerprint(funcdef, *(ast.Constant(c) for c in calls)), True, where, (base, found))

    def home(self, module: types.ModuleType) -> types.ModuleType:
        # What it patches is found through sys.modules (TE's base module and its callers), not
        # through the ``transformer_engine.pytorch`` object whose import triggers it.
        return sys.modules.get(BASE) or module

    def install(self, module: types.ModuleType, found: Inspection, undo: Undo, cfg: Config) -> str | None:
        base, callers = found.payload
        replacement = per_call_dummy(vars(base)[NAME])
        for caller in callers:
            undo.set(caller, NAME, replacement)
        return None


TARGET = DummyWgradTarget(
    name="te-dummy-wgrad",
    distribution="transformer-engine",
    module="transformer_engine.pytorch",
    relies_on=f"{NAME} and its calls",
)
