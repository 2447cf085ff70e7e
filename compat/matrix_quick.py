"""pytest plugin of the version matrix (compat/matrix.py loads it with ``-p matrix_quick``).

With ``GEMM_PATCH_MATRIX_QUICK=1`` it deselects the tests that start a Python process (each one
imports torch and megatron again: about 4 CPU-seconds, most of a release's test time). The
matrix sets it for a release whose recorded fingerprints, for every target, equal those of a
release that runs the whole folder in the same interpreter: the code gemm_patch relies on is
the same, so the process-level tests (import order, strict mode, summary lines, threads) would
repeat the same run; every in-process test still runs against the release itself, a sweep once
per check.

A sweep (``@pytest.mark.sweep("tied", "distributed", ...)``) repeats one check of a fix over the
layouts those parameters name, through code whose recorded fingerprints are the same on both
releases: a quick release runs the first layout of each combination of its other parameters (each
change, each target), the whole-folder release every layout. The contract (tests/contract.py: the
states, the gate on unknown code in both modes, revert, reload, re-import, what megatron reaches)
is no sweep: it runs whole on every release. At its end a run says what it left to another
release (``LEFT``).

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
import re
import types

PROVES = "proves"  # @pytest.mark.proves("fsdp-wgrad", ...): the targets whose fix a test proves
COMMON_MACHINERY = "common_machinery"  # @pytest.mark.common_machinery: the same on every release
COMMON_ELSEWHERE = "common"  # in GEMM_PATCH_MATRIX_PROCESS_ELSEWHERE: COMMON_MACHINERY runs on another release
SWEEP = "sweep"  # @pytest.mark.sweep("tied", ...): the parameters a test repeats one check over
# What a release's run leaves to another, said at its end for compat/matrix.py (``left_elsewhere``).
LEFT = "matrix_quick: left to another release: {processes} process tests, {layouts} layouts of sweeps"

_left: list[str] = []  # this process's LEFT line, once its tests are selected
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


def sweep_key(item) -> tuple | None:
    """For a test marked ``sweep``: its function and the values of its other parameters (a quick
    release runs the first test of each key); None for any other test."""
    swept = {name for mark in item.iter_markers(SWEEP) for name in mark.args}
    if not swept:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    return str(item.path), item.originalname, tuple((k, repr(v)) for k, v in sorted(params.items()) if k not in swept)


def left_elsewhere(output: str) -> tuple[int, int]:
    """(process tests, layouts of sweeps) that a release's run left to another, read from its output."""
    found = re.search(LEFT.format(processes=r"(\d+)", layouts=r"(\d+)"), output)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


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
    keep, processes, layouts, seen = [], [], [], set()
    for item in items:
        key = sweep_key(item) if quick else None
        if starts_a_process(getattr(item, "function", None)) and (quick or _elsewhere(item, elsewhere)):
            processes.append(item)
        elif key is not None and key in seen:
            layouts.append(item)
        else:
            keep.append(item)
            if key is not None:
                seen.add(key)
    if processes or layouts:
        config.hook.pytest_deselected(items=processes + layouts)
        items[:] = keep
    _left[:] = [LEFT.format(processes=len(processes), layouts=len(layouts))]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for line in _left:
        terminalreporter.write_line(line)
