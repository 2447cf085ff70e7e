"""Find one call expression inside a function's source and build a twin of that function in
which only that call goes somewhere else.

Why an AST rewrite: the call to replace is ``torch.matmul(...)`` in the middle of a 100-line
``backward``. Wrapping ``backward`` cannot reach it, and swapping ``torch`` (or ``torch.matmul``)
in megatron's namespace would change every other matmul of the module. Rewriting one node of
the parsed function, compiling it against the module's own globals with its original file name
and line numbers, changes that one call and nothing else: every other statement is the same
bytecode reading the same live globals, tracebacks point to megatron's own file and lines, and
the replacement reaches the dispatcher through a closure cell, so no name is added to
megatron's module.
"""

from __future__ import annotations
import __future__

import ast
import copy
import hashlib
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field

FACTORY = "__gemm_patch_factory__"


class CallSiteError(Exception):
    """The target function cannot be analysed or rewritten; the message is the skip reason."""


@dataclass
class AnalysedFunction:
    module: types.ModuleType
    funcdef: ast.FunctionDef
    fingerprint: str
    matches: list[ast.AST]  # the matched calls (``analyse``) or statements (``analyse_statement``)


# Fields whose presence depends on the Python version, not on the code (3.12 added
# ``type_params``; 3.13's ast.dump hides empty fields): left out so a fingerprint taken on one
# Python matches the same source parsed by another.
_VERSION_DEPENDENT_FIELDS = frozenset({"type_params", "type_comment"})


def canonical_dump(node: object) -> str:
    """``ast.dump`` without positions and without empty or version-dependent fields."""
    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if name in _VERSION_DEPENDENT_FIELDS or value is None or value == []:
                continue
            fields.append(f"{name}={canonical_dump(value)}")
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(canonical_dump(item) for item in node) + "]"
    return repr(node)


def fingerprint(*nodes: ast.AST | None) -> str:
    """A digest of AST nodes: stable across formatting, comments and Python versions (3.10+),
    changed by any edit to code or decorators."""
    dump = "\n".join(canonical_dump(node) for node in nodes if node is not None)
    return hashlib.sha256(dump.encode()).hexdigest()[:16]


def parse_module(module: types.ModuleType) -> ast.Module:
    """The module's source, parsed; CallSiteError where there is no source to read."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError) as exc:
        raise CallSiteError(
            f"no source for {module.__name__} ({exc}); a bytecode-only install cannot be "
            "checked, so it is left untouched"
        ) from None
    return ast.parse(source)


def parse_method(module: types.ModuleType, owner: str, attribute: str) -> ast.FunctionDef | None:
    """``owner.attribute`` parsed out of the module's source; None where the module has no such
    method; CallSiteError where there is no source to read."""
    return _find_method(parse_module(module), owner, attribute)


def analyse(module: types.ModuleType, owner: str, attribute: str, call: str) -> AnalysedFunction:
    """Parse ``owner.attribute`` out of the module's source and find every ``call`` in it."""
    funcdef = parse_method(module, owner, attribute)
    if funcdef is None:
        raise CallSiteError(f"{module.__name__} has no {owner}.{attribute}")
    return AnalysedFunction(module, funcdef, fingerprint(funcdef), find_calls(funcdef, call))


def find_calls(funcdef: ast.AST, call: str) -> list[ast.Call]:
    """Every statement-level ``call`` (compared as ASTs) inside ``funcdef``."""
    template = ast.dump(ast.parse(call, mode="eval").body)
    return [node.value for node in ast.walk(funcdef)
            if isinstance(node, ast.Expr) and ast.dump(node.value) == template]


def analyse_statement(module: types.ModuleType, owner: str, attribute: str,
                      statement: str) -> AnalysedFunction | None:
    """Parse ``owner.attribute`` out of the module's source and find every occurrence of the
    simple statement ``statement`` (compared as ASTs, so formatting and comments do not matter)
    at any depth in it; None where the module has no such method."""
    funcdef = parse_method(module, owner, attribute)
    if funcdef is None:
        return None
    template = canonical_dump(ast.parse(statement).body[0])
    matches = [node for node in ast.walk(funcdef)
               if isinstance(node, ast.stmt) and canonical_dump(node) == template]
    return AnalysedFunction(module, funcdef, fingerprint(funcdef), matches)


def _find_method(tree: ast.Module, owner: str, attribute: str) -> ast.FunctionDef | None:
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and cls.name == owner:
            for node in cls.body:
                if isinstance(node, ast.FunctionDef) and node.name == attribute:
                    return node
    return None


def _refuse_unportable(funcdef: ast.FunctionDef) -> None:
    # A method compiled outside its class body loses name mangling and the __class__ cell.
    for node in ast.walk(funcdef):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        if name in ("super", "__class__") or (name.startswith("__") and not name.endswith("__")):
            raise CallSiteError(f"{funcdef.name} uses {name!r}, which cannot be recompiled outside its class")


@dataclass
class Redirect:
    """Send ``matches`` (calls found by ``find_calls``) to ``function``, reached inside the twin
    through a closure variable called ``name``, with ``extra_keywords`` (keyword -> local name)."""

    matches: list[ast.Call]
    name: str
    function: Callable
    extra_keywords: dict[str, str] = field(default_factory=dict)


class _RedirectCalls(ast.NodeTransformer):
    def __init__(self, redirects: list[Redirect]):
        self.by_dump = {ast.dump(t, include_attributes=True): r for r in redirects for t in r.matches}

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        redirect = self.by_dump.get(ast.dump(node, include_attributes=True))
        if redirect is None:
            return node
        extra = [ast.keyword(arg=k, value=ast.Name(id=v, ctx=ast.Load()))
                 for k, v in redirect.extra_keywords.items()]
        new = ast.Call(func=ast.Name(id=redirect.name, ctx=ast.Load()), args=node.args,
                       keywords=node.keywords + extra)
        return ast.copy_location(new, node)


def build_twin(analysed: AnalysedFunction, qualname: str, redirects: list[Redirect]):
    """The decorated twin of the analysed function with each redirect's calls sent to its
    function; returns what the class body's ``def`` would have bound (for a ``@staticmethod``
    that is the staticmethod object)."""
    funcdef = copy.deepcopy(analysed.funcdef)
    _refuse_unportable(funcdef)
    funcdef = _RedirectCalls(redirects).visit(funcdef)
    decorators, funcdef.decorator_list = funcdef.decorator_list, []

    names = ", ".join(r.name for r in redirects)
    factory = ast.parse(f"def {FACTORY}({names}):\n    pass\n").body[0]
    factory.body = [funcdef, ast.Return(value=ast.Name(id=funcdef.name, ctx=ast.Load()))]
    tree = ast.fix_missing_locations(ast.Module(body=[factory], type_ignores=[]))

    module = analysed.module
    filename = getattr(module, "__file__", None) or f"<{module.__name__}>"
    flags = 0
    if module.__dict__.get("annotations") is __future__.annotations:
        flags |= __future__.annotations.compiler_flag
    code = compile(tree, filename, "exec", flags=flags, dont_inherit=True)
    namespace: dict = {}
    # Globals are the module's own dict (live lookups of torch, HAVE_TE, ...); the factory
    # lands in ``namespace``, so the module gains no name.
    exec(code, module.__dict__, namespace)
    function = namespace[FACTORY](*(r.function for r in redirects))
    function.__qualname__ = qualname

    decorated = function
    for decorator in reversed(decorators):
        expression = ast.fix_missing_locations(ast.Expression(body=decorator))
        decorated = eval(compile(expression, filename, "eval", dont_inherit=True), module.__dict__)(decorated)
    return decorated
