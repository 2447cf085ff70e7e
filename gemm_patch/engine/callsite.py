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
    matches: list[ast.AST]  # the matched calls (``find_call_site``) or statements (``find_statement``)


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


# Every apply() judges the same functions of the same parsed trees again (the trees are cached per
# source text, and only read): what is derived from a tree's nodes is remembered per node, keyed by
# the nodes' ids and holding the nodes themselves, so that an id cannot be reused while its entry
# lives.
_DERIVED: dict[tuple, tuple[tuple, object]] = {}
_DERIVED_SIZE = 512


def _derived(kind: str, nodes: tuple, extra: object, make: Callable[[], object],
             cache: dict = _DERIVED, size: int = _DERIVED_SIZE) -> object:
    key = (kind, tuple(map(id, nodes)), extra)
    entry = cache.get(key)
    if entry is not None and all(a is b for a, b in zip(entry[0], nodes, strict=True)):
        return entry[1]
    value = make()
    if len(cache) >= size:
        cache.pop(next(iter(cache)))
    cache[key] = (nodes, value)
    return value


def fingerprint(*nodes: ast.AST | None) -> str:
    """A digest of AST nodes: stable across formatting, comments and Python versions (3.10+),
    changed by any edit to code or decorators."""
    return _derived("fingerprint", nodes, None, lambda: _digest(*nodes))


def _digest(*nodes: ast.AST | None) -> str:
    import hashlib  # only when a module is judged, not at ``import gemm_patch``

    dump = "\n".join(canonical_dump(node) for node in nodes if node is not None)
    return hashlib.sha256(dump.encode()).hexdigest()[:16]


def code_fingerprint(*nodes: ast.AST | None) -> str:
    """``fingerprint`` of the nodes without their docstrings (the string that opens a function's or
    class's body): the same for code that differs only in its docstrings and comments."""
    return _derived("code_fingerprint", nodes, None, lambda: _bare_digest(*nodes))


def _bare_digest(*nodes: ast.AST | None) -> str:
    bare = []
    for node in nodes:
        if node is None:
            continue
        node = copy.deepcopy(node)
        for inner in ast.walk(node):
            body = getattr(inner, "body", None)
            if (isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                inner.body = body[1:] or [ast.Pass()]
        bare.append(node)
    return _digest(*bare)


def _source(module: types.ModuleType) -> str:
    try:
        return inspect.getsource(module)
    except (OSError, TypeError) as exc:
        raise CallSiteError(
            f"no source for {module.__name__} ({exc}); a bytecode-only install cannot be "
            "checked, so it is left untouched"
        ) from None


# Parsing and compiling a module's source is most of what judging a target costs (layers.py and
# megatron_fsdp.py are read by several targets, each parse and compile tens of milliseconds): each
# is done once per source text. Keyed by the text itself, so an edited file is read afresh; the
# trees handed out are only read (twins are built from deep copies).
_PARSED: dict[str, ast.Module] = {}
_COMPILED: dict[tuple[str, str], types.CodeType] = {}
_CACHE_SIZE = 16
_READ: dict[tuple, tuple[tuple, object]] = {}  # read_module's: it holds whole trees, as _PARSED does


def _remember(cache: dict, key, make):
    value = cache.get(key)
    if value is None:
        value = make()
        if len(cache) >= _CACHE_SIZE:
            cache.pop(next(iter(cache)))
        cache[key] = value
    return value


def _parse(source: str) -> ast.Module:
    return _remember(_PARSED, source, lambda: ast.parse(source))


def _compile(source: str, filename: str) -> types.CodeType:
    """The module's code as its import compiled it (from the text: compiling the parsed tree
    gives other bytecode)."""
    return _remember(_COMPILED, (filename, source),
                     lambda: compile(source, filename, "exec", dont_inherit=True))


def parse_module(module: types.ModuleType) -> ast.Module:
    """The module's source, parsed; CallSiteError where there is no source to read."""
    return _parse(_source(module))


def read_module(module: types.ModuleType, kind: str, extra: object, read: Callable[[ast.Module], object]) -> object:
    """``read(tree)`` of the module's parsed source, remembered per tree (a tree per source text)
    under ``kind`` and ``extra``: a target that walks a whole module walks it once, and again
    only where the source changed. What ``read`` returns is shared: it must not be changed."""
    tree = parse_module(module)
    return _derived(kind, (tree,), extra, lambda: read(tree), _READ, _CACHE_SIZE)


def parse_method(module: types.ModuleType, owner: str, attribute: str) -> ast.FunctionDef | None:
    """``owner.attribute`` parsed out of the module's source; None where the module has no such
    method; CallSiteError where there is no source to read."""
    return _find_method(parse_module(module), owner, attribute)


def find_call_site(module: types.ModuleType, owner: str, attribute: str, call: str) -> AnalysedFunction:
    """Parse ``owner.attribute`` out of the module's source and find every ``call`` in it."""
    funcdef = parse_method(module, owner, attribute)
    if funcdef is None:
        raise CallSiteError(f"{module.__name__} has no {owner}.{attribute}")
    return AnalysedFunction(module, funcdef, fingerprint(funcdef), find_calls(funcdef, call))


def find_calls(funcdef: ast.AST, call: str) -> list[ast.Call]:
    """Every statement-level ``call`` (compared as ASTs) inside ``funcdef``."""
    return list(_derived("find_calls", (funcdef,), call, lambda: _find_calls(funcdef, call)))


def _find_calls(funcdef: ast.AST, call: str) -> list[ast.Call]:
    template = ast.dump(ast.parse(call, mode="eval").body)
    return [node.value for node in ast.walk(funcdef)
            if isinstance(node, ast.Expr) and ast.dump(node.value) == template]


def find_assigned_calls(funcdef: ast.AST, call: str) -> list[ast.Call]:
    """Every ``call`` (compared as ASTs) that is the whole value of a one-name assignment
    (``grad_weight = call``) inside ``funcdef``."""
    return list(_derived("find_assigned_calls", (funcdef,), call, lambda: _find_assigned_calls(funcdef, call)))


def _find_assigned_calls(funcdef: ast.AST, call: str) -> list[ast.Call]:
    template = ast.dump(ast.parse(call, mode="eval").body)
    return [node.value for node in ast.walk(funcdef)
            if isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name) and ast.dump(node.value) == template]


def find_statement(module: types.ModuleType, owner: str, attribute: str,
                      statement: str) -> AnalysedFunction | None:
    """Parse ``owner.attribute`` out of the module's source and find every occurrence of the
    simple statement ``statement`` (compared as ASTs, so formatting and comments do not matter)
    at any depth in it; None where the module has no such method."""
    funcdef = parse_method(module, owner, attribute)
    if funcdef is None:
        return None
    matches = list(_derived("find_statement", (funcdef,), statement, lambda: _find_statements(funcdef, statement)))
    return AnalysedFunction(module, funcdef, fingerprint(funcdef), matches)


def _find_statements(funcdef: ast.AST, statement: str) -> list[ast.stmt]:
    template = canonical_dump(ast.parse(statement).body[0])
    return [node for node in ast.walk(funcdef) if isinstance(node, ast.stmt) and canonical_dump(node) == template]


def _find_class(tree: ast.Module, owner: str) -> ast.ClassDef | None:
    return next((c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == owner), None)


def _find_method(tree: ast.Module, owner: str, attribute: str) -> ast.FunctionDef | None:
    cls = _find_class(tree, owner)
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == attribute), None) \
        if cls is not None else None


def _future_flags(module: types.ModuleType) -> int:
    return __future__.annotations.compiler_flag if module.__dict__.get("annotations") is __future__.annotations \
        else 0


def check_live_is_source(module: types.ModuleType, owner: str, attribute: str) -> None:
    """Raise CallSiteError unless ``owner.attribute`` of the live module is the function its
    source file defines, with the decorators it names: another library may have replaced it
    (its code would silently never run again under a twin built from the file), or the file
    may have changed since the import.

    The class body is compiled from the parsed file with the file's name and positions; the
    live object and that function, both with the source's decorators unwrapped layer by layer
    (``__wrapped__``), must have equal code objects at every layer.
    """
    source = _source(module)
    tree = _parse(source)
    funcdef = _find_method(tree, owner, attribute)
    cls = vars(module).get(owner)
    if funcdef is None or not isinstance(cls, type) or attribute not in vars(cls):
        raise CallSiteError(f"{module.__name__}.{owner}.{attribute} is not in both the file and the live module")
    code = _compile(source, _filename(module))
    body = next((c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == owner), None)
    expected_code = next((c for c in body.co_consts if isinstance(c, types.CodeType) and c.co_name == attribute),
                         None) if body is not None else None
    if expected_code is None:
        raise CallSiteError(f"{owner}.{attribute} cannot be compiled from {module.__name__}'s source")
    expected = _decorate(types.FunctionType(expected_code, module.__dict__), funcdef.decorator_list, module)
    live = vars(cls)[attribute]
    if _layers(live) != _layers(expected):
        raise CallSiteError(
            f"{module.__name__}.{owner}.{attribute} is not megatron's own function from "
            f"{_filename(module)}: the live object is {type(live).__module__}.{type(live).__qualname__}"
            f"{_origin(live)}; left untouched, since patching it would drop whatever replaced it")


def check_live_function_is_source(module: types.ModuleType, name: str) -> ast.FunctionDef:
    """The module-level function ``name`` as parsed from the module's file; CallSiteError unless
    the live ``module.name`` is that very function with the decorators the file names (each
    layer's code object equal to the file's compiled code, as ``check_live_is_source``)."""
    source = _source(module)
    funcdef = next((n for n in _parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if funcdef is None:
        raise CallSiteError(f"{module.__name__}.{name} is not a function of its file")
    code = _compile(source, _filename(module))
    expected_code = next((c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name), None)
    live = vars(module).get(name)
    expected = _decorate(types.FunctionType(expected_code, module.__dict__), funcdef.decorator_list, module) \
        if expected_code is not None else None
    if expected is None or _layers(live) != _layers(expected):
        raise CallSiteError(f"{module.__name__}.{name} is not the function of {_filename(module)}: the live "
                            f"object is {type(live).__module__}.{type(live).__qualname__}{_origin(live)}")
    return funcdef


def _layers(obj: object) -> list[object]:
    """The code object (or, for a callable object, the type) of each decorator layer."""
    layers = []
    seen = 0
    while obj is not None and seen < 16:
        seen += 1
        if isinstance(obj, (staticmethod, classmethod)):
            layers.append(type(obj))
            obj = obj.__func__
            continue
        layers.append(getattr(obj, "__code__", type(obj)))
        obj = getattr(obj, "__wrapped__", None) if isinstance(obj, types.FunctionType) else None
    return layers


def same_function(a: object, b: object) -> bool:
    """Whether ``a`` and ``b`` run the same code in the same globals: equal code objects at
    every decorator layer, and the innermost functions' globals one dict (a module's earlier
    and later execution by ``importlib.reload``; not a fresh import, which has a dict of its own)."""
    if a is None or b is None or _layers(a) != _layers(b):
        return False
    return getattr(_innermost(a), "__globals__", None) is getattr(_innermost(b), "__globals__", False)


def _innermost(obj: object) -> object:
    for _ in range(16):
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        elif isinstance(obj, types.FunctionType) and getattr(obj, "__wrapped__", None) is not None:
            obj = obj.__wrapped__
        else:
            break
    return obj


def _origin(obj: object) -> str:
    inner = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    code = getattr(inner, "__code__", None)
    return f" ({code.co_qualname if hasattr(code, 'co_qualname') else code.co_name} from " \
           f"{code.co_filename}:{code.co_firstlineno})" if code is not None else ""


def _filename(module: types.ModuleType) -> str:
    return getattr(module, "__file__", None) or f"<{module.__name__}>"


def _decorate(function, decorators: list[ast.expr], module: types.ModuleType):
    decorated = function
    for decorator in reversed(decorators):
        expression = ast.fix_missing_locations(ast.Expression(body=decorator))
        decorated = eval(compile(expression, _filename(module), "eval", dont_inherit=True), module.__dict__)(decorated)
    return decorated


def _refuse_unportable(funcdef: ast.FunctionDef) -> None:
    unportable = _derived("unportable", (funcdef,), None, lambda: _unportable(funcdef))
    if unportable:
        raise CallSiteError(f"{funcdef.name} uses {unportable!r}, which cannot be recompiled outside its class")


def _unportable(funcdef: ast.FunctionDef) -> str:
    # A method compiled outside its class body loses name mangling and the __class__ cell (a bare
    # ``super``/``__class__``); an attribute such as ``obj.__class__`` reads the same anywhere.
    for node in ast.walk(funcdef):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        if (isinstance(node, ast.Name) and name in ("super", "__class__")) or \
                (name.startswith("__") and not name.endswith("__")):
            return name
    return ""


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
    # The edit is named by what it does (each redirected call, its position included, the name and
    # keywords it gets), so that the same redirects of the same function reuse one compiled factory.
    edit_key = tuple((tuple(ast.dump(m, include_attributes=True) for m in r.matches), r.name,
                      tuple(r.extra_keywords.items())) for r in redirects)
    return _build(analysed, qualname, _RedirectCalls(redirects).visit, {r.name: r.function for r in redirects},
                  ("redirect", edit_key))


def build_edited_twin(analysed: AnalysedFunction, qualname: str,
                      edit: Callable[[ast.FunctionDef], object], cells: dict[str, Callable]):
    """The twin of the analysed function after ``edit`` has changed a deep copy of its
    FunctionDef in place (a call redirect, one statement of a nested function, ...). The names
    the new code calls are the closure variables ``cells`` (name -> object), so the module gains
    no name. Compiled against the module's own globals, file name and line numbers; returns what
    the class body's ``def`` would have bound."""
    # A module-level function without a closure edits the same tree the same way every time.
    plain = isinstance(edit, types.FunctionType) and not edit.__closure__ and not edit.__defaults__
    return _build(analysed, qualname, edit, cells, ("edit", edit) if plain else None)


def _build(analysed: AnalysedFunction, qualname: str, edit: Callable[[ast.FunctionDef], object],
           cells: dict[str, Callable], edit_key: object):
    """``build_edited_twin``; ``edit_key`` (None: none) names the edit, so that the compiled factory
    of the same edit of the same tree, for the same module's file and flags, is compiled once.
    Each call still runs the factory: the twin is a new function over its own cells."""
    module = analysed.module
    extra = (edit_key, tuple(cells), _filename(module), _future_flags(module))
    made = _derived("twin", (analysed.funcdef,), extra,
                    lambda: _compile_factory(analysed, edit, cells)) if edit_key is not None \
        else _compile_factory(analysed, edit, cells)
    code, decorators = made
    namespace: dict = {}
    # Globals are the module's own dict (live lookups of torch, HAVE_TE, ...); the factory
    # lands in ``namespace``, so the module gains no name.
    exec(code, module.__dict__, namespace)
    function = namespace[FACTORY](*cells.values())
    function.__qualname__ = qualname
    return _decorate(function, decorators, module)


def _compile_factory(analysed: AnalysedFunction, edit: Callable[[ast.FunctionDef], object],
                     cells: dict[str, Callable]) -> tuple[types.CodeType, list[ast.expr]]:
    """The code of a module defining the factory of the edited function, and its decorators."""
    _refuse_unportable(analysed.funcdef)
    funcdef = copy.deepcopy(analysed.funcdef)
    edit(funcdef)
    decorators, funcdef.decorator_list = funcdef.decorator_list, []

    factory = ast.parse(f"def {FACTORY}({', '.join(cells)}):\n    pass\n").body[0]
    factory.body = [funcdef, ast.Return(value=ast.Name(id=funcdef.name, ctx=ast.Load()))]
    tree = ast.fix_missing_locations(ast.Module(body=[factory], type_ignores=[]))
    module = analysed.module
    return compile(tree, _filename(module), "exec", flags=_future_flags(module), dont_inherit=True), decorators

