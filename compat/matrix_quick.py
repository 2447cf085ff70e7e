"""pytest plugin of the version matrix (compat/matrix.py loads it with ``-p matrix_quick``).

With ``GEMM_PATCH_MATRIX_QUICK=1`` it deselects the tests that start a Python process (each one
imports torch and megatron again: about 4 CPU-seconds, most of a release's test time). The
matrix sets it for a release whose recorded fingerprints, for every target, equal those of a
release that runs the whole folder in the same interpreter: the code gemm_patch relies on is
the same, so the process-level tests (import order, strict mode, summary lines, threads) would
repeat the same run; every in-process test still runs against the release itself.

A test starts a process when its code, or a function it calls by a global name (followed
through helpers, in any module), uses ``subprocess`` or ``sys.executable``.
"""

from __future__ import annotations

import os
import types

_SPAWN_NAMES = frozenset({"subprocess", "executable", "Popen", "check_output", "check_call"})


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def starts_a_process(function, seen: set | None = None) -> bool:
    seen = set() if seen is None else seen
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    names: set[str] = set()
    for inner in _code_objects(code):
        names.update(inner.co_names)
    if names & _SPAWN_NAMES:
        return True
    scope = getattr(function, "__globals__", {})
    return any(starts_a_process(scope[name], seen) for name in names
               if isinstance(scope.get(name), (types.FunctionType, types.MethodType)))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GEMM_PATCH_MATRIX_QUICK") != "1":
        return
    keep, drop = [], []
    for item in items:
        (drop if starts_a_process(getattr(item, "function", None)) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
