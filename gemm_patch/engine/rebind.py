"""An object built before a twin was installed, brought under the twin in place.

A method that registers hooks as closures (Megatron-FSDP's ``_register_fsdp_hooks``) leaves each
object it ran for with nested functions made from the method's code at that moment. Where the
twin changes nested functions only, the object can run the twin without registering anything
again: each of its nested functions of those names is swapped, where its hooks hold it (a
closure cell shared by the other nested functions, or a ``functools.partial`` a hook dict holds),
for one made from the twin's nested code over the same cells. The hooks keep their order among
the host's own, and putting the originals back is exact.

The swapped-in function carries the original it replaced (``ORIGINAL``), so that nothing outside
the object's own references holds it: an object dropped by its user is collected as before.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from typing import Any

ORIGINAL = "_gemm_patch_original"


def nested_codes(function: Any, names: Iterable[str]) -> dict[str, types.CodeType] | None:
    """The code objects of ``function``'s nested functions named ``names`` (one each), or None."""
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    found: dict[str, types.CodeType] = {}
    for name in names:
        matches = [c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name]
        if len(matches) != 1:
            return None
        found[name] = matches[0]
    return found


def closure_cells(function: types.FunctionType) -> dict[str, Any]:
    return dict(zip(function.__code__.co_freevars, function.__closure__ or (), strict=True))


def _reachable(places: Iterable[dict]) -> tuple[list[tuple[dict, Any]], list[Any]]:
    """What the hook dicts ``places`` hold, followed through partials and closures: every
    (dict, key) whose value is a partial, and every closure cell met (each once)."""
    partials: list[tuple[dict, Any]] = []
    cells: dict[int, Any] = {}
    seen: set[int] = set()
    todo: list[Any] = []
    for place in {id(d): d for d in places}.values():  # each dict once: a value is replaced once
        for key, value in list(place.items()):
            if isinstance(value, functools.partial):
                partials.append((place, key))
            todo.append(value)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            todo += [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                cells.setdefault(id(cell), cell)
                try:
                    todo.append(cell.cell_contents)
                except ValueError:  # an empty cell: a name not bound yet
                    pass
    return partials, list(cells.values())


def swap_in(places: Iterable[dict], original: Any, twin: Any, names: tuple[str, ...], owner: Any) -> bool:
    """Swap ``owner``'s nested functions ``names`` made from ``original``'s code, wherever the
    hook dicts ``places`` reach them, for the twin's; True where at least one was swapped and
    every one found could be. Nothing is changed otherwise (an object built from other code, a
    nested function the twin needs a name for that neither closure has)."""
    old, new = nested_codes(original, names), nested_codes(twin, names)
    if old is None or new is None or not isinstance(twin, types.FunctionType):
        return False
    by_code = {code: new[name] for name, code in old.items()}
    twin_cells = closure_cells(twin)
    partials, cells = _reachable(places)
    made: dict[int, Any] = {}

    def replacement(fn: Any) -> Any:
        if not (isinstance(fn, types.FunctionType) and fn.__code__ in by_code):
            return fn
        if id(fn) not in made:
            own = closure_cells(fn)
            if "self" in own and own["self"].cell_contents is not owner:
                return fn  # another object's closure
            code = by_code[fn.__code__]
            if any(n not in own and n not in twin_cells for n in code.co_freevars):
                raise LookupError(code.co_name)
            closure = tuple(own[n] if n in own else twin_cells[n] for n in code.co_freevars)
            swapped = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, closure)
            swapped.__kwdefaults__ = fn.__kwdefaults__
            setattr(swapped, ORIGINAL, fn)
            made[id(fn)] = swapped
        return made[id(fn)]

    try:
        new_cells = [(cell, replacement(cell.cell_contents)) for cell in cells if _holds_function(cell)]
        new_partials = []
        for place, key in partials:
            p = place[key]
            swapped = functools.partial(replacement(p.func), *map(replacement, p.args),
                                        **{k: replacement(v) for k, v in p.keywords.items()})
            if swapped.func is not p.func or swapped.args != p.args or swapped.keywords != p.keywords:
                new_partials.append((place, key, swapped))
    except LookupError:
        return False
    if not made:
        return False
    for cell, fn in new_cells:
        if fn is not cell.cell_contents:
            cell.cell_contents = fn
    for place, key, swapped in new_partials:
        setattr(swapped, ORIGINAL, place[key])
        place[key] = swapped
    return True


def _holds_function(cell: Any) -> bool:
    try:
        return isinstance(cell.cell_contents, types.FunctionType)
    except ValueError:
        return False


def swap_back(places: Iterable[dict]) -> int:
    """Put back every original ``swap_in`` replaced where the hook dicts ``places`` reach it;
    the number of places restored."""
    partials, cells = _reachable(places)
    restored = 0
    for place, key in partials:
        original = getattr(place[key], ORIGINAL, None)
        if original is not None:
            place[key] = original
            restored += 1
    for cell in cells:
        original = getattr(cell.cell_contents, ORIGINAL, None) if _holds_function(cell) else None
        if original is not None:
            cell.cell_contents = original
            restored += 1
    return restored
