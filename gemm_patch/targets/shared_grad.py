"""fsdp-shared-grad / mfsdp-shared-grad: Megatron-FSDP keeps the other uses' gradient of a weight
whose fused wgrad went into ``main_grad`` when megatron marks it ``zero_out_wgrad``.

A weight used more than once in one backward, some uses through the fused wgrad and others
through plain autograd (the tied embedding/output weight: output projection fused, embedding
lookup not), reaches the gradient hook with its fused products already in ``main_grad``,
``grad_added_to_main_grad`` set, and the lookup's gradient in ``param.grad`` on top of
megatron's zero dummy. ``LanguageModule`` marks that weight ``zero_out_wgrad = True`` (the dummy
is zeros exactly so that ``param.grad`` can be added), and megatron's DDP adds ``param.grad`` when
``not grad_added_to_main_grad or zero_out_wgrad``. Megatron-FSDP's post-backward hook
``_grad_acc`` (nested in ``MegatronFSDP._register_fsdp_hooks``) deletes ``param.grad`` whenever
the flag is set, so the embedding's gradient is lost.

The patch rebuilds ``_register_fsdp_hooks`` from its source with one statement of the nested
``_grad_acc`` changed::

    if param.grad_added_to_main_grad and param.grad is not None:
        _gemm_patch_shared_grad(param, to_local_if_dtensor)   # added
        del param.grad

``add_shared_grad`` adds ``param.grad`` into ``param.get_main_grad()`` (the same persistent view,
or the same not-yet-reduced fresh bucket, that the fused writes of this backward went into) only
for a ``zero_out_wgrad`` weight, as DDP does. The method runs once per MegatronFSDP, in its
``__init__``: instances built before the patch keep upstream's hooks.

The twin also puts one call first in ``_grad_acc``::

    _gemm_patch_written_flag(param)   # added: fsdp_rules.restore_written_flag

With ``enable_fine_grained_param_gather_hook`` every module unshards its weights before its
own backward, and each unshard clears ``grad_added_to_main_grad``: the tied weight reaches
``_grad_acc`` with the output layer's fused wgrad in main_grad but the flag cleared by the
embedding's unshard, and upstream's ``main_grad.copy_(param.grad)`` overwrites the fused
gradient. The call sets the flag again where fsdp-wgrad recorded a fused write of this backward
(``wgrad_accumulates``), so the statement above adds instead. And one call first in the method
itself::

    _gemm_patch_hooks_end_records(self, root_module)   # added: fsdp_rules.hooks_end_records

marks the instance and the parameters these hooks handle: only for them may such a record make
a fused write add (under hooks the twin did not build, nothing ends the record where the
gradient is handed on). The patcher finds MegatronFSDP instances built before the patch at
``apply()`` and brings them under it (the record made by the same call); one whose hooks were
made by other code, or one fsdp-wgrad meets in the middle of a backward (its first write into a
parameter no twin's hooks handle), keeps upstream's hooks and the target reads ``bypassed``
while it lives.

On megatron-core 0.14-0.15 (megatron-fsdp 0.1-0.2) the twin makes two more edits. There a
pre-forward hook on every module passes each tensor argument that requires grad through an
identity autograd Function (``RegisterFSDPBackwardFunction``), so that the module's post-backward
hook fires. The tied weight, handed to the output layer as ``weight=``, comes out of it as a
non-leaf tensor without ``__fsdp_param__`` or ``main_grad``, and megatron's fused branch fails on
the first backward (``'NoneType' object has no attribute 'dtype'``), with or without the rest of
gemm-patch. The nested ``_register_post_backward_hook`` now leaves Megatron-FSDP parameters out of
that Function: the output layer receives the parameter itself and takes the Megatron-FSDP branch
its own weight would take; the hook still fires from the module's activations. And a third:
that hook runs ``_grad_acc`` and the reduce of the bucket after each call of a module, so a
weight used twice per backward (the output layer under multi-token prediction) would be handed
on after its first use, and its second fused write would go into a bucket already reduced, or
freed and fetched again, or (sharing the bucket with parameters still to come) overwrite the
first use. After the hook's ``_is_shared`` filter the twin leaves out the weights with a fused write
of this backward whose ``.grad`` autograd has not accumulated yet (``without_pending_uses``): a
use is still to come; a later call of the hook, or the root post-backward hook, takes them, so
``_grad_acc`` and the reduce run once, after every use, as on 0.16+. Only where the method's
fingerprint is in ``param_arg_fingerprints`` (0.16+ register that hook on FSDP units under
``optim_grads_params`` only, where no weight argument is known to pass, and run ``_grad_acc``
from each parameter's post-accumulate-grad hook: left as it is).
"""

from __future__ import annotations

import ast
import functools
import types
from dataclasses import dataclass
from typing import Any

from ..engine import release_data
from ..engine.callsite import (
    AnalysedFunction,
    CallSiteError,
    build_edited_twin,
    canonical_dump,
    check_live_is_source,
    fingerprint,
    parse_method,
)
from ..engine.config import Config
from ..engine.rebind import closure_cells, swap_back, swap_in
from ..engine.target import DEFAULTS, Inspection, MethodTarget, PatchedTwin, Undo, in_both_fsdp_packages
from ..upstream.fsdp_rules import (
    HOOKED,
    MANAGED,
    MODEL_CONFIG,
    current_backward,
    hooks_end_records,
    hooks_end_records_per_module_call,
    is_fsdp_param,
    lookup_written,
    only_zeros,
    restore_written_flag,
    without_pending_uses,
)

ATTRIBUTE = "_register_fsdp_hooks"
NESTED = "_grad_acc"
STATEMENT = "if param.grad_added_to_main_grad and param.grad is not None:\n    del param.grad\n"
TO_LOCAL = "to_local_if_dtensor"
CELL = "_gemm_patch_shared_grad"
FLAG_CELL = "_gemm_patch_written_flag"


def add_shared_grad(param: Any, to_local: Any) -> None:
    """Megatron's DDP rule for a weight whose fused wgrad is already in main_grad: with
    ``zero_out_wgrad`` the dummy wgrad megatron returned is zeros, so ``param.grad`` holds the
    gradient of the weight's other, non-fused uses (the tied embedding lookup) and is added;
    without it the dummy may be uninitialised memory and ``param.grad`` is dropped, as upstream.
    A weight whose embedding lookup fsdp-embedding-wgrad wrote into main_grad in this backward
    follows the first rule (its dummies are zeros); where only such a zero dummy reached
    ``param.grad`` (``only_zeros``) there is nothing to add."""
    if only_zeros(param):
        return
    if getattr(param, "zero_out_wgrad", False) or lookup_written(param):
        param.main_grad = param.get_main_grad()
        param.main_grad.add_(to_local(param.grad))


ARG_HOOK = "_register_post_backward_hook"
ARG_TEST = "torch.is_tensor(obj) and obj.requires_grad"
ARG_CELL = "_gemm_patch_is_fsdp_param"
MANAGED_CELL = "_gemm_patch_hooks_end_records"
POST_HOOK = "_post_backward"
SHARED_FILTER = 'param_list = [p for p in param_list if not getattr(p, "_is_shared", False)]'
PENDING_CELL = "_gemm_patch_without_pending_uses"


def _nested(funcdef: ast.FunctionDef, name: str = NESTED) -> list[ast.FunctionDef]:
    return [n for n in funcdef.body if isinstance(n, ast.FunctionDef) and n.name == name]


def _statements(nested: ast.FunctionDef) -> list[ast.If]:
    template = canonical_dump(ast.parse(STATEMENT).body[0])
    return [n for n in nested.body if isinstance(n, ast.If) and canonical_dump(n) == template]


def _one_nested(funcdef: ast.FunctionDef, name: str) -> ast.FunctionDef:
    nested = _nested(funcdef, name)
    if len(nested) != 1:
        raise CallSiteError(f"{len(nested)} nested `def {name}` in {funcdef.name}")
    return nested[0]


def _site(funcdef: ast.FunctionDef) -> ast.If:
    """The one statement to change, in ``funcdef`` (the method or a copy of it)."""
    statements = _statements(_one_nested(funcdef, NESTED))
    if len(statements) != 1:
        raise CallSiteError(f"{len(statements)} `{STATEMENT.splitlines()[0]}` in {NESTED}")
    return statements[0]


def _arg_site(funcdef: ast.FunctionDef) -> ast.If:
    """The ``if`` that picks which tensor arguments go through the identity Function."""
    hook = _one_nested(funcdef, ARG_HOOK)
    template = canonical_dump(ast.parse(ARG_TEST, mode="eval").body)
    found = [n for n in ast.walk(hook) if isinstance(n, ast.If) and canonical_dump(n.test) == template]
    if len(found) != 1:
        raise CallSiteError(f"{len(found)} `if {ARG_TEST}:` in {ARG_HOOK}")
    return found[0]


def _pending_site(funcdef: ast.FunctionDef) -> ast.Assign:
    """The ``_is_shared`` filter of the per-module-call post-backward hook (0.14-0.15)."""
    hook = _one_nested(funcdef, POST_HOOK)
    template = canonical_dump(ast.parse(SHARED_FILTER).body[0])
    found = [n for n in hook.body if isinstance(n, ast.Assign) and canonical_dump(n) == template]
    if len(found) != 1:
        raise CallSiteError(f"{len(found)} `{SHARED_FILTER}` in {POST_HOOK}")
    return found[0]


def _after_docstring(body: list) -> int:
    return 1 if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str) else 0


def _call(name: str, *args: str) -> ast.Expr:
    return ast.Expr(value=ast.Call(func=ast.Name(id=name, ctx=ast.Load()),
                                   args=[ast.Name(id=a, ctx=ast.Load()) for a in args], keywords=[]))


def _edit_grad_acc(funcdef: ast.FunctionDef) -> None:
    statement = _site(funcdef)
    # Positions of the `del`: a traceback through the added call points at megatron's line.
    statement.body.insert(0, ast.copy_location(_call(CELL, "param", TO_LOCAL), statement.body[0]))
    # First in _grad_acc, after its docstring; at the position of the statement it precedes.
    body = _nested(funcdef)[0].body
    first = _after_docstring(body)
    body.insert(first, ast.copy_location(_call(FLAG_CELL, "param"), body[first]))
    # First in the method itself: the instance and the parameters it registers hooks for get these hooks.
    first = _after_docstring(funcdef.body)
    instance, root = funcdef.args.args[0].arg, funcdef.args.args[1].arg
    funcdef.body.insert(first, ast.copy_location(_call(MANAGED_CELL, instance, root), funcdef.body[first]))


def _edit_both(funcdef: ast.FunctionDef) -> None:
    _edit_grad_acc(funcdef)
    statement = _arg_site(funcdef)
    keep_out = ast.UnaryOp(op=ast.Not(), operand=ast.Call(func=ast.Name(id=ARG_CELL, ctx=ast.Load()),
                                                          args=[ast.Name(id="obj", ctx=ast.Load())], keywords=[]))
    statement.test = ast.copy_location(ast.BoolOp(op=ast.And(), values=[statement.test, keep_out]), statement.test)
    # After the _is_shared filter: a weight with a use still to come is left to a later call.
    shared_filter = _pending_site(funcdef)
    nested = _nested(funcdef, POST_HOOK)[0].body
    pending = ast.Assign(targets=[ast.Name(id="param_list", ctx=ast.Store())],
                         value=ast.Call(func=ast.Name(id=PENDING_CELL, ctx=ast.Load()),
                                        args=[ast.Name(id="param_list", ctx=ast.Load())], keywords=[]))
    nested.insert(nested.index(shared_filter) + 1, ast.copy_location(pending, shared_filter))


def _root(instance: Any) -> Any:
    return getattr(instance, "module", None)  # a registered submodule: not in its __dict__


HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
              "_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def hook_places(instance: Any) -> list[dict]:
    """Where a MegatronFSDP's hooks are held: its own attributes, the hook dicts of it and of
    every module of the model it wraps, each parameter's post-accumulate-grad hooks and
    attributes (``post_wgrad_grad_acc_hook``)."""
    root = _root(instance)
    modules = [instance, *(root.modules() if callable(getattr(root, "modules", None)) else ())]
    params = list(root.parameters()) if callable(getattr(root, "parameters", None)) else []
    places = [vars(instance)]
    places += [d for m in modules for name in HOOK_DICTS if isinstance(d := vars(m).get(name), dict)]
    places += [d for p in params for d in (getattr(p, "_post_accumulate_grad_hooks", None), vars(p))
               if isinstance(d, dict)]
    return places


def _twin_step(undo: Undo, instance: Any) -> Any:
    """The step of ``undo`` that installed the twin on ``instance``'s class (or None)."""
    return next((s for s in reversed(undo.steps) if isinstance(s.owner, type) and s.name == ATTRIBUTE
                 and issubclass(type(instance), s.owner) and isinstance(s.installed, PatchedTwin)), None)


def _edited(twin_cells: dict) -> tuple[str, ...]:
    """The nested functions the twin with these cells edits."""
    return (NESTED, ARG_HOOK, POST_HOOK) if ARG_CELL in twin_cells else (NESTED,)


def _unmark(instance: Any) -> None:
    HOOKED.discard(instance)
    root = _root(instance)
    for param in root.parameters() if callable(getattr(root, "parameters", None)) else ():
        MANAGED.pop(param)
        MODEL_CONFIG.pop(param)


def _put_back(instance: Any) -> None:
    """Undo of ``SharedGradTarget.runs_patched`` bringing ``instance`` under the twin. A fault
    leaves it recorded: status names it as keeping the patch (``kept_patched``)."""
    try:
        swap_back(hook_places(instance))
    except Exception:
        return
    _unmark(instance)


def _built_under(managed: Any, undo: Undo, instance: Any, root_module: Any) -> None:
    """The twin's first statement (``MANAGED_CELL``): ``managed`` records the instance and its
    parameters (fsdp_rules.hooks_end_records), and the install's undo will put the instance on
    megatron's own nested functions (``_to_upstream``)."""
    managed(instance, root_module)
    undo.adopt(instance, functools.partial(_to_upstream, undo))


def _to_upstream(undo: Undo, instance: Any) -> None:
    """Undo for an instance built under the twin: its nested functions the twin edited swapped
    for ones made from megatron's code over the same cells, as if megatron had built it. Where
    they cannot be found (its hooks removed), it stays recorded and status names it."""
    step = _twin_step(undo, instance)
    if step is None:
        return
    twin = step.installed._self_gemm_patch_twin
    try:
        swapped = swap_in(hook_places(instance), twin, step.original, _edited(closure_cells(twin)), instance)
    except Exception:  # a fault must not stop revert(): status names the instance
        return
    if swapped:
        _unmark(instance)


@dataclass(frozen=True, kw_only=True, eq=False)
class SharedGradTarget(MethodTarget):
    # Fingerprints of the method where every module call's weight arguments pass through the
    # identity Function (0.14-0.15): the twin keeps Megatron-FSDP parameters out of it there.
    # None (the default): the target's entry in gemm_patch/engine/releases.json.
    param_arg_fingerprints: frozenset[str] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.param_arg_fingerprints is None:
            object.__setattr__(self, "param_arg_fingerprints", frozenset(
                release_data.entry(self.name).get("param_arg_fingerprints", ())))

    def inspect(self, module: types.ModuleType, cfg: Config = DEFAULTS) -> Inspection:
        funcdef = parse_method(module, self.owner, self.attribute)
        if funcdef is None or self.live_object(module) is None:
            return Inspection(None, False, f"{module.__name__} has no {self.where}")
        fp = fingerprint(funcdef)
        if not _nested(funcdef):
            return Inspection(fp, False, f"no nested `def {NESTED}` in {self.where}")
        if not any(_statements(n) for n in _nested(funcdef)):
            return Inspection(fp, False, f"no `{STATEMENT.splitlines()[0]} del param.grad` in "
                                         f"{self.where}.{NESTED}")
        _site(funcdef)  # exactly one of each, or CallSiteError: skipped
        if len(funcdef.args.args) < 2:
            raise CallSiteError(f"{self.where} takes no root module argument")
        if fp in self.param_arg_fingerprints:
            _arg_site(funcdef)
            _pending_site(funcdef)
        if not callable(vars(module).get(TO_LOCAL)):
            raise CallSiteError(f"{module.__name__} has no global {TO_LOCAL}")
        check_live_is_source(module, self.owner, self.attribute)
        return Inspection(fp, True, f"{self.where}.{NESTED}", AnalysedFunction(module, funcdef, fp, []))

    def runs_patched(self, instance: Any, undo: Undo) -> bool:
        if instance in HOOKED:
            return True
        # Its hooks are closures made when it was built: registering them again would change
        # their order among the host's own hooks, so the nested functions the twin edits are
        # swapped where those hooks hold them. Not inside a backward: the writes of the one
        # running were judged under upstream's hooks.
        backward = current_backward()
        if backward is not None and backward >= 0:
            return False
        step = _twin_step(undo, instance)
        if step is None:
            return False
        twin = step.installed._self_gemm_patch_twin
        cells = closure_cells(twin)
        try:
            if not swap_in(hook_places(instance), step.original, twin, _edited(cells), instance):
                return False  # built by other code: reported (bypassed)
        except Exception:  # a fault here must not take apply() down: the instance is reported
            return False
        managed = hooks_end_records_per_module_call if ARG_CELL in cells else hooks_end_records
        managed(instance, _root(instance))
        undo.adopt(instance, _put_back)
        return True

    def kept_patched(self) -> list:
        import sys

        cls = vars(sys.modules.get(self.module) or types.ModuleType("absent")).get(self.owner)
        return [obj for obj in list(HOOKED) if isinstance(cls, type) and isinstance(obj, cls)]

    def install(self, module: types.ModuleType, found: Inspection, undo: Undo, cfg: Config) -> str | None:
        both = found.fingerprint in self.param_arg_fingerprints
        managed = hooks_end_records_per_module_call if both else hooks_end_records
        cells = {CELL: add_shared_grad, FLAG_CELL: restore_written_flag,
                 MANAGED_CELL: functools.partial(_built_under, managed, undo),
                 **({ARG_CELL: is_fsdp_param, PENDING_CELL: without_pending_uses} if both else {})}
        twin = build_edited_twin(found.payload, self.where, _edit_both if both else _edit_grad_acc, cells)
        self.replace(module, undo, PatchedTwin(self.live_object(module), twin))
        return (f"{ARG_HOOK}: Megatron-FSDP parameters passed as arguments stay parameters; {POST_HOOK}: "
                "a weight with a use still to come waits for it") if both else None


_COMMON = dict(
    switch="GEMM_PATCH_SHARED_GRAD",
    relies_on="hook registration",
    owner="MegatronFSDP",
    attribute=ATTRIBUTE,
    runs_at_build=True,  # from MegatronFSDP.__init__: its hooks are closures of that call
)

TARGET, STANDALONE = in_both_fsdp_packages(SharedGradTarget, "fsdp-shared-grad", "megatron_fsdp", **_COMMON)
