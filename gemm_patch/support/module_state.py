"""What ``sys.modules`` says about a module, read without importing anything: whether its code is
still executing (an import under way, in this thread or another) and whether it could be found.
The lowest layer: standard library only, used by the GEMM backends and the engine alike."""

from __future__ import annotations

import sys
import types
from importlib import machinery, util


def still_importing(module: types.ModuleType) -> bool:
    """True while ``module``'s own code is still executing (importlib's ``_initializing``)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def importing(name: str) -> bool:
    """True while module ``name`` or a package above it is in ``sys.modules`` with its code still
    executing, in this thread or another: importing ``name`` now could deadlock with that import."""
    parts = name.split(".")
    return any((module := sys.modules.get(".".join(parts[:depth]))) is not None and still_importing(module)
               for depth in range(1, len(parts) + 1))


def module_findable(name: str) -> bool | None:
    """Whether ``import name`` would find a module, decided without importing anything: False
    when its top-level package is not installed at all; once that package is imported, each
    level not imported yet is looked up in the ``__path__`` of the level above. None when it
    cannot be told yet (package installed, not imported) or a finder fails."""
    parts = name.split(".")
    top = sys.modules.get(parts[0])
    if top is None:
        try:  # a top-level lookup on sys.path imports nothing
            return False if util.find_spec(parts[0]) is None else None
        except (ImportError, ValueError):
            return None
    path = getattr(top, "__path__", None)
    for depth in range(2, len(parts) + 1):
        if path is None:
            return False  # a plain module where a package would be needed
        full = ".".join(parts[:depth])
        module = sys.modules.get(full)
        if module is not None:
            path = getattr(module, "__path__", None)
            continue
        try:
            spec = machinery.PathFinder.find_spec(full, list(path))
            if spec is None and full.rpartition(".")[0] in sys.modules:
                spec = util.find_spec(full)  # other finders; the parent is imported already
        except (ImportError, ValueError):
            return None
        if spec is None:
            return False
        path = spec.submodule_search_locations
    return True
