"""pytest plugin of the version matrix (compat/matrix.py loads it with ``-p matrix_quick``).

With ``GEMM_PATCH_MATRIX_QUICK=1`` it deselects the tests that start a Python process (each one
imports torch and megatron again: about 4 CPU-seconds, most of a release's test time). The
matrix sets it for a release whose recorded fingerprints, for every target, equal those of a
release that runs the whole folder in the same interpreter: the code gemm_patch relies on is
the same, so the process-level tests (import order, strict mode, summary lines, threads) would
repeat the same run; every in-process test still runs against the release itself.

Per fix, too: on a release that runs the whole folder, ``GEMM_PATCH_MATRIX_PROCESS_ELSEWHERE``
names the targets whose code here is identical to a newer release's that runs the whole folder
as well, in whichever interpreter; the process tests that prove them (their ``proves`` marker,
``@pytest.mark.proves("fsdp-wgrad")``) run there only (apex-wgrad's code, for one, is the same
in every megatron-core release).

And the process tests of machinery that no release's code changes (``@pytest.mark.common_machinery``:
the gate's default and strict modes around an import, threads, reloads, the rank rule, import
order) run on the component's newest whole-folder release only (the others get ``common`` in that variable):
what of them does depend on the release is checked on every release in-process by the contract
(tests/contract.py: unknown code in both modes, reload, re-import, import order per target).

A test starts a process when its code, or a function it calls by a global name (followed
through helpers, in any module), uses ``subprocess`` or ``sys.executable``.
"""

from __future__ import annotations

import os
import types

PROVES = "proves"  # @pytest.mark.proves("fsdp-wgrad", ...): the targets whose fix a test proves
COMMON_MACHINERY = "common_machinery"  # @pytest.mark.common_machinery: the same on every release
COMMON_ELSEWHERE = "common"  # in GEMM_PATCH_MATRIX_PROCESS_ELSEWHERE: COMMON_MACHINERY runs on another release

_SPAWN_NAMES = frozenset({"subprocess", "executable", "Popen", "check_output", "check_call"})


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def starts_a_process(function, seen: set | None = None) -> bool:
    seen = set() if seen is None else seen
    function = getattr(function, "__func__", function)
    function = getattr(function, "__wrapped__", function)  # functools.cache and other wrappers
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
               if isinstance(getattr(scope.get(name), "__wrapped__", scope.get(name)),
                             (types.FunctionType, types.MethodType)))


def proven_by(item) -> tuple[str, ...]:
    """The targets the item's ``proves`` markers name (on the test, its class or its module)."""
    return tuple(dict.fromkeys(name for mark in item.iter_markers(PROVES) for name in mark.args))


def is_common(item) -> bool:
    return item.get_closest_marker(COMMON_MACHINERY) is not None


def _elsewhere(item, targets: frozenset[str]) -> bool:
    """Every fix the item proves is proven on another release (same code), or the item is
    common machinery run on another release."""
    if COMMON_ELSEWHERE in targets and is_common(item):
        return True
    proves = proven_by(item)
    return bool(proves) and set(proves) <= targets


def pytest_collection_modifyitems(config, items):
    for item in items:  # for the junit report: compat/adopt.py credits each test's outcome by it
        proves = proven_by(item)
        if proves:
            item.user_properties.append((PROVES, ",".join(proves)))
    quick = os.environ.get("GEMM_PATCH_MATRIX_QUICK") == "1"
    elsewhere = frozenset(filter(None, os.environ.get("GEMM_PATCH_MATRIX_PROCESS_ELSEWHERE", "").split(",")))
    if not quick and not elsewhere:
        return
    keep, drop = [], []
    for item in items:
        spawns = starts_a_process(getattr(item, "function", None))
        (drop if spawns and (quick or _elsewhere(item, elsewhere)) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
