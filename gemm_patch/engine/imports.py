"""Post-import hooks that fire after every execution of a watched module.

wrapt's post-import hooks fire once per name and are then forgotten, so a module imported a
second time (after a failed first import, or after ``del sys.modules[...]``) or reloaded with
``importlib.reload`` would run unpatched while status still described the first module object.
``PostImportFinder`` sits first on ``sys.meta_path``, lets the other finders find a watched
module, and wraps the loader so that the callback runs right after each ``exec_module``: first
imports, re-imports and reloads alike (``importlib.reload`` looks the spec up again). The
wrapper puts the module's own loader back before executing it, so the module never sees it.
Standard library only.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import types
from collections.abc import Callable

from ..support.module_state import still_importing

Callback = Callable[[types.ModuleType], None]


class _NotifyingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, callback: Callback) -> None:
        self._loader = loader
        self._callback = callback

    def __getattr__(self, name: str):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._callback(module)


class PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._callbacks: dict[str, Callback] = {}
        self._searching = threading.local()

    def watch(self, name: str, callback: Callback) -> None:
        self._callbacks[name] = callback

    def find_spec(self, fullname, path, target=None):
        callback = self._callbacks.get(fullname)
        searching = self._searching.__dict__.setdefault("names", set())
        if callback is None or fullname in searching:
            return None
        searching.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            searching.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _NotifyingLoader(spec.loader, callback)
        return spec


_finder: PostImportFinder | None = None
_lock = threading.Lock()


def watch(name: str, callback: Callback) -> None:
    """Run ``callback(module)`` after every execution of module ``name`` from now on."""
    global _finder
    with _lock:
        if _finder is None or _finder not in sys.meta_path:
            _finder = _finder or PostImportFinder()
            sys.meta_path.insert(0, _finder)
        _finder.watch(name, callback)




def wait_until_imported(name: str) -> types.ModuleType | None:
    """Block until another thread's import of ``name`` has finished (importlib's per-module
    lock) and return the finished module; None where it is this thread's own import that is
    still running, or where waiting would deadlock."""
    try:
        module = importlib.import_module(name)
    except Exception:
        return None
    return None if still_importing(module) else module
