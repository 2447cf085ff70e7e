"""GEMM_PATCH_MOE_ROUTER_WGRAD: a fused write of the MoE router's weight gradient into ``main_grad``
that gemm-patch has not verified is reported, and left to megatron.

moe-router-wgrad: Megatron-LM's design for an fp32 router (PR #6943) computes the router's
weight gradient with megatron's ``te_general_gemm`` straight into ``weight.main_grad``, with a
new ``accumulate`` argument: a fused writer beside the linear layers' one. Under Megatron-FSDP
such a write must add into the persistent buffer and write over a fresh, unzeroed bucket
(``wgrad_accumulates``): whether that writer does is not known here. So the target patches
nothing: on ``megatron.core.transformer.moe.router`` code with a GEMM whose ``out`` is a
``main_grad``, it reads ``unverified`` with one WARNING naming the functions, and the writer runs
as megatron has it; on code without one (every release up to 0.19), ``not applicable``.
"""

from __future__ import annotations

import ast
import types
from dataclasses import dataclass

from ..engine.callsite import fingerprint, read_module
from ..engine.config import Config
from ..engine.target import DEFAULTS, Inspection, Target, Undo

MODULE = "megatron.core.transformer.moe.router"


def writes_main_grad(call: ast.Call) -> bool:
    """A GEMM call (a name ending in ``gemm``) whose ``out=`` is a ``main_grad``."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name.endswith("gemm") and any(
        k.arg == "out" and "main_grad" in ast.unparse(k.value) for k in call.keywords)


def _writers(tree: ast.Module) -> tuple[tuple[str, ast.AST], ...]:
    """(qualified name, outermost function) of each fused write into ``main_grad`` in the module."""
    where: list[tuple[str, ast.AST]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(isinstance(c, ast.Call) and writes_main_grad(c) for c in ast.walk(child)):
                    where.append((prefix + child.name, child))

    visit(tree, "")
    return tuple(where)


@dataclass(frozen=True, kw_only=True, eq=False)
class WriterWatch(Target):
    """Reports fused writes into ``main_grad`` in its module; installs nothing."""

    def inspect(self, module: types.ModuleType, cfg: Config = DEFAULTS) -> Inspection:
        where = read_module(module, "main_grad_writers", None, _writers)
        if not where:
            return Inspection(None, False, f"no fused write into main_grad in {module.__name__}")
        names = ", ".join(name for name, _ in where)
        return Inspection(fingerprint(*(node for _, node in where)), False,
                          f"a fused write of a weight gradient into main_grad in {module.__name__} ({names}), "
                          "which gemm-patch has not verified under Megatron-FSDP's buffers (add into the persistent "
                          "one, write over a fresh bucket)")

    def install(self, module: types.ModuleType, found: Inspection, undo: Undo, cfg: Config) -> str | None:
        raise AssertionError("moe-router-wgrad installs nothing")  # inspect never finds a site


TARGET = WriterWatch(
    name="moe-router-wgrad",
    distribution="megatron-core",
    module=MODULE,
    switch="GEMM_PATCH_MOE_ROUTER_WGRAD",
    relies_on="router code",
)
