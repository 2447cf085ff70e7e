"""pytest plugin of the version matrix (compat/matrix.py loads it with ``-p matrix_quick``).

With ``GEMM_PATCH_MATRIX_QUICK=1`` it deselects the tests that start a Python process (each one
imports torch and megatron again: about 4 CPU-seconds, most of a release's test time). The
matrix sets it for a release whose recorded fingerprints, for every target, equal those of a
release that runs the whole folder in the same interpreter: the code gemm_patch relies on is
the same, so the process-level tests (import order, strict mode, summary lines, threads) would
repeat the same run; every in-process test still runs against the release itself.

Per fix, too: on a release that runs the whole folder, ``GEMM_PATCH_MATRIX_PROCESS_ELSEWHERE``
names the targets whose code here is identical to a newer release's that runs the whole folder
as well, in whichever interpreter; the process tests of their files (``TEST_TARGETS``) run there
only (apex-wgrad's code, for one, is the same in every megatron-core release).

And the process tests of machinery that no release's code changes (``COMMON``: the gate's
default and strict modes around an import, threads, reloads, the rank rule, import order) run on
the component's newest whole-folder release only (the others get ``common`` in that variable):
what of them does depend on the release is checked on every release in-process by the contract
(tests/contract.py: unknown code in both modes, reload, re-import, import order per target).

A test starts a process when its code, or a function it calls by a global name (followed
through helpers, in any module), uses ``subprocess`` or ``sys.executable``.
"""

from __future__ import annotations

import os
import types

TEST_TARGETS: dict[str, tuple[str, ...]] = {
    "test_fsdp_wgrad.py": ("fsdp-wgrad",),
    "test_fsdp_accumulate.py": ("fsdp-wgrad",),
    "test_fsdp_dummy_grad.py": ("fsdp-wgrad",),
    "test_safety.py": ("fsdp-wgrad",),
    "test_reimport.py": ("fsdp-wgrad",),
    "test_fsdp_te_overwrite.py": ("fsdp-te-overwrite",),
    "test_moe_overwrite.py": ("moe-te-overwrite",),
    "test_mfsdp_te_overwrite.py": ("mfsdp-te-overwrite",),
    "test_shared_weights.py": ("fsdp-wgrad", "fsdp-shared-grad", "mfsdp-shared-grad"),
    "test_fine_grained_gather.py": ("fsdp-wgrad", "fsdp-shared-grad", "mfsdp-shared-grad"),
    "test_tied_dummy_memory.py": ("fsdp-wgrad", "fsdp-shared-grad", "mfsdp-shared-grad"),
    "test_one_rank_scale.py": ("fsdp-one-rank-scale",),
    "test_mfsdp_one_rank_scale.py": ("mfsdp-one-rank-scale",),
    "test_apex_wgrad.py": ("apex-wgrad",),
    "test_apex_replace.py": ("apex-wgrad",),
    "test_mcore_main_targets.py": ("fsdp-wgrad-gemm", "fsdp-te-overwrite-by-strategy",
                                   "mfsdp-te-overwrite-by-strategy", "moe-te-overwrite",
                                   "fsdp-one-rank-scale", "mfsdp-one-rank-scale"),
}

# "file" (all of its process tests), "file::test" (every parameter) or "file::test[id]".
COMMON: frozenset[str] = frozenset({
    "test_safety.py",
    # a fresh process per order; in-process, apply after the import is "module first" and the
    # contract's re-import goes through the post-import hook ("gemm_patch first") on every release
    "test_contract.py::test_import_order",
    "test_fsdp_wgrad.py::test_import_order_does_not_matter",
    "test_fsdp_wgrad.py::test_unknown_code_is_left_alone_unless_allowed_and_refused_in_strict_mode[default]",
    "test_fsdp_wgrad.py::test_unknown_code_is_left_alone_unless_allowed_and_refused_in_strict_mode[strict]",
    "test_fsdp_te_overwrite.py::test_unknown_code_is_left_alone_unless_allowed_and_refused_in_strict_mode[default]",
    "test_fsdp_te_overwrite.py::test_unknown_code_is_left_alone_unless_allowed_and_refused_in_strict_mode[strict]",
    "test_fsdp_te_overwrite.py::test_one_summary_line_and_at_most_one_more_on_rank_0[1]",
    "test_summary_lines.py::test_other_ranks_say_nothing_at_info",
    "test_summary_lines.py::test_rank_0_names_each_fix_once_at_info[no RANK]",
})
COMMON_ELSEWHERE = "common"  # in GEMM_PATCH_MATRIX_PROCESS_ELSEWHERE: COMMON runs on another release

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


def is_common(item) -> bool:
    name = os.path.basename(str(getattr(item, "fspath", "")))
    return bool({name, f"{name}::{getattr(item, 'originalname', item.name)}", f"{name}::{item.name}"} & COMMON)


def _elsewhere(item, targets: frozenset[str]) -> bool:
    """Every fix the item's file proves is proven on another release (same code), or the item
    is common machinery run on another release."""
    if COMMON_ELSEWHERE in targets and is_common(item):
        return True
    proves = TEST_TARGETS.get(os.path.basename(str(getattr(item, "fspath", ""))), ())
    return bool(proves) and set(proves) <= targets


def pytest_collection_modifyitems(config, items):
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
