"""The contract every registered target honours, whatever it patches (after ddtrace's
``PatchTestCase``): a new target in ``gemm_patch.targets.REGISTRY`` gets these tests for free,
against every release of its component (tests/megatron/test_contract.py,
tests/megatron_fsdp/test_contract.py).

Each check runs in this process, on the release's real module, with only the target under test
applied (every other one listed in ``GEMM_PATCH_DISABLE``), so that what changed is the target's
own doing. "What changed" is read from shallow snapshots: ``vars()`` of every module of the
target's package that is imported, and of the classes defined there, compared by identity.
Where the target is expected patched, what changed must be exactly the places its install
recorded (``Undo`` steps); where it is not applicable (``Target.expected_state``), nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import json
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from functools import cache
from typing import Any

import pytest

import gemm_patch
from gemm_patch.engine import patcher
from gemm_patch.engine.target import NOT_APPLICABLE, OFF, PATCHED_STATES, PENDING, REPLACED, UNVERIFIED, Step, Target
from gemm_patch.targets import REGISTRY

IGNORED = frozenset({"__warningregistry__"})


def targets_of(component: str) -> list[Target]:
    return [t for t in REGISTRY if t.distribution == component]


def params(component: str) -> list:
    return [pytest.param(t, id=t.name, marks=pytest.mark.proves(t.name)) for t in targets_of(component)]


def state_of(name: str):
    return {t.name: t for t in gemm_patch.status().targets}[name]


# -- snapshots ----------------------------------------------------------------------------------

def scope_modules(target: Target) -> list[types.ModuleType]:
    """The imported modules of the target's package (its module and its siblings)."""
    package = target.module.rpartition(".")[0]
    return [m for name, m in list(sys.modules.items())
            if isinstance(m, types.ModuleType) and (name == package or name.startswith(package + "."))]


class Snapshot:
    """Identity of every value in ``vars()`` of ``modules`` and of the classes they define."""

    def __init__(self, modules: list[types.ModuleType]) -> None:
        names = {m.__name__ for m in modules}
        owners: dict[int, Any] = {}
        for module in modules:
            owners[id(module)] = module
            for value in list(vars(module).values()):
                if isinstance(value, type) and getattr(value, "__module__", None) in names:
                    owners[id(value)] = value
        self.owners = owners  # held, so that the ids stay valid
        self.values = self._read()

    def _read(self) -> dict[tuple[int, str], Any]:
        # Submodules bound on their package change on a re-import: not a patch.
        return {(id(o), k): v for o in self.owners.values() for k, v in list(vars(o).items())
                if k not in IGNORED and not (isinstance(v, types.ModuleType)
                                             and v.__name__ == f"{getattr(o, '__name__', '')}.{k}")}

    def changed(self) -> set[tuple[int, str]]:
        """The places whose value is no longer the same object as at the snapshot."""
        now = self._read()
        return {key for key in self.values.keys() | now.keys()
                if key not in self.values or key not in now or self.values[key] is not now[key]}


def describe(places: set[tuple[int, str]], snapshot: Snapshot) -> list[str]:
    return sorted(f"{getattr(snapshot.owners.get(i), '__qualname__', getattr(snapshot.owners.get(i), '__name__', i))}"
                  f".{name}" for i, name in places)


def steps(target: Target) -> list[Step]:
    """Every recorded assignment of the target's installs, oldest install first."""
    return [step for install in patcher._state.installs.get(target.name, []) for step in install.undo.steps]


def places(steps_: list[Step]) -> set[tuple[int, str]]:
    return {(id(step.owner), step.name) for step in steps_ if not step.is_item}


def holds_installed(steps_: list[Step]) -> list[str]:
    """The places that still hold what gemm_patch installed there."""
    return [step.where() for step in steps_ if step.in_place()]


def lost(steps_: list[Step]) -> list[str]:
    """The places that no longer hold what gemm_patch installed there."""
    return [step.where() for step in steps_ if not step.in_place()]


# -- the configuration under test -----------------------------------------------------------------

@contextlib.contextmanager
def environ(**variables: str | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in variables}
    for k, v in variables.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def only(target: Target, registry: tuple[Target, ...] | None = None) -> Iterator[None]:
    """Everything reverted, then (on entry) nothing applied and every target but ``target``
    left out through GEMM_PATCH_DISABLE; on exit the registry, the variable and every patch as
    they were (all applied)."""
    gemm_patch.revert()
    others = ",".join(t.name for t in REGISTRY if t.name != target.name)
    try:
        with environ(GEMM_PATCH_DISABLE=others):
            if registry is not None:
                patcher.use_targets(registry)
            yield
    finally:
        gemm_patch.revert()
        patcher.use_targets(REGISTRY)
        gemm_patch.apply()


def import_module(target: Target) -> types.ModuleType | None:
    try:
        return importlib.import_module(target.module)
    except ImportError:
        return None


def patched(expect: str) -> bool:
    return expect in PATCHED_STATES


# -- the checks ------------------------------------------------------------------------------------

IMPORT_ORDER = """
import importlib, json, sys
order, modules = sys.argv[1], sys.argv[2].split(",")
def import_targets():
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
if order == "module first":
    import_targets()
import gemm_patch
from gemm_patch.engine import patcher
before = {t.name: t.state for t in gemm_patch.status().targets}
import_targets()
found = {}
for target in patcher.targets():
    installs = patcher._state.installs.get(target.name) or []
    live = sys.modules.get(target.module)
    found[target.name] = {
        "state": {t.name: t.state for t in gemm_patch.status().targets}[target.name],
        "on_live_module": bool(installs) and installs[-1].module is live
                          and target.in_place(live, installs[-1].undo) is None,
        "before_import": before[target.name],
    }
print("CONTRACT", json.dumps(found))
"""


@cache
def import_order_run(order: str, modules: tuple[str, ...]) -> dict[str, dict]:
    """A fresh interpreter imports the target modules before or after ``import gemm_patch``
    (one run per order and component, shared by every target)."""
    # The expectations and the gate stay as the run sets them (adoption opens the gate for its code).
    keep = ("GEMM_PATCH_MATRIX_EXPECT", "GEMM_PATCH_ALLOW_UNVERIFIED")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH") or k in keep}
    out = subprocess.run([sys.executable, "-c", IMPORT_ORDER, order, ",".join(modules)],
                         capture_output=True, text=True, env=env, timeout=300)
    line = next((line for line in out.stdout.splitlines() if line.startswith("CONTRACT ")), None)
    assert out.returncode == 0 and line, out.stderr[-3000:]
    return json.loads(line[len("CONTRACT "):])


def check_import_order(target: Target, expect: str, order: str, component: str) -> None:
    modules = tuple(sorted({t.module for t in targets_of(component)}))
    found = import_order_run(order, modules)[target.name]
    assert found["state"] == expect, found
    assert found["on_live_module"] == patched(expect), found
    if order == "gemm_patch first":  # what status said before the import agrees with what it made
        assert found["before_import"] == (PENDING if patched(expect) else expect), found


def check_apply_revert_apply(target: Target, expect: str) -> None:
    with only(target):
        module = import_module(target)
        before = Snapshot(scope_modules(target))
        gemm_patch.apply()
        assert state_of(target.name).state == expect, state_of(target.name).reason
        recorded = steps(target)
        changed = before.changed()
        if not patched(expect):
            assert not recorded and not changed, describe(changed, before)
            return
        assert module is not None and recorded
        in_scope = {p for p in places(recorded) if p[0] in before.owners}
        assert changed and changed == in_scope, (describe(changed, before), describe(in_scope, before))
        if hasattr(target, "where"):
            owner = vars(sys.modules[getattr(target, "buffers_module", target.module)])[target.owner]
            assert (id(owner), target.attribute) in changed, f"{target.where} is not what changed"

        gemm_patch.revert()
        assert state_of(target.name).state == OFF
        assert not before.changed(), f"after revert(): {describe(before.changed(), before)}"
        assert not holds_installed(recorded)

        gemm_patch.apply()
        assert state_of(target.name).state == expect
        assert before.changed() == changed, "apply() after revert() patches the same places"
        assert not lost(steps(target))


def check_reload(target: Target, expect: str) -> None:
    with only(target):
        module = import_module(target)
        if module is None:
            pytest.skip(f"no module {target.module} in this release")
        gemm_patch.apply()
        original = dict(vars(module))  # patched contents, put back (reverted) afterwards
        gemm_patch.revert()
        unpatched = dict(vars(module))
        gemm_patch.apply()
        try:
            assert importlib.reload(module) is module
            assert state_of(target.name).state == expect, state_of(target.name).reason
            if patched(expect):
                latest = patcher._state.installs[target.name][-1]
                assert latest.module is module and target.in_place(module, latest.undo) is None
                assert not lost(latest.undo.steps)
                recorded = steps(target)
                gemm_patch.revert()
                assert not holds_installed(recorded), "revert() restores what the reload made too"
            else:
                assert not steps(target)
        finally:
            gemm_patch.revert()
            vars(module).clear()
            vars(module).update(unpatched)
            del original


def check_reimport(target: Target, expect: str) -> None:
    """``del sys.modules[name]`` and a fresh import: the new module is patched, and so is the
    old module object (megatron's code may hold it, or objects from it)."""
    with only(target):
        old = import_module(target)
        if old is None:
            pytest.skip(f"no module {target.module} in this release")
        parent_name, _, short = target.module.rpartition(".")
        parent = sys.modules.get(parent_name)
        before_old = Snapshot(scope_modules(target))
        gemm_patch.apply()
        old_steps = steps(target)
        del sys.modules[target.module]
        try:
            new = importlib.import_module(target.module)
            assert new is not old
            assert state_of(target.name).state == expect, state_of(target.name).reason
            if not patched(expect):
                assert not steps(target) and not before_old.changed()
                return
            installs = patcher._state.installs[target.name]
            assert installs[-1].module is new and target.in_place(new, installs[-1].undo) is None
            assert not lost(old_steps), "the old module object keeps gemm_patch's objects"
            assert not lost(installs[-1].undo.steps)
            all_steps = steps(target)
            gemm_patch.revert()
            assert not before_old.changed(), f"old module after revert(): {describe(before_old.changed(), before_old)}"
            assert not holds_installed(all_steps), "revert() restores the old and the new module"
            stand_ins = [f"{short}.{k}" for k, v in vars(new).items() if getattr(v, "__gemm_patch_stand_in__", False)]
            assert not stand_ins, f"the new module keeps gemm_patch objects after revert(): {stand_ins}"
        finally:
            gemm_patch.revert()
            sys.modules[target.module] = old
            if parent is not None:
                setattr(parent, short, old)
            forget(target.module, keep=old)


def forget(name: str, keep: types.ModuleType) -> None:
    """The module objects of ``name`` a check made and dropped again (a fresh import after
    ``del sys.modules``): nothing holds them any more, so the patcher need not patch them on
    every later apply() of the test run."""
    seen = getattr(patcher._state, "seen", {}).get(name)
    if seen is not None:
        seen[:] = [m for m in seen if m is keep]


# -- what megatron can reach, after a sequence of imports, reloads, revert() and apply() ---------

def _wgrad_runs_patched(layers: types.ModuleType) -> bool:
    """megatron's own fused-wgrad function of ``layers``, two micro-batches into a persistent
    fp32 Megatron-FSDP buffer: True where they add up (patched); False where the bf16 product
    cannot be written into fp32 (upstream's dtype error) or only the last one survives."""
    import torch

    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 4, generator=gen).to(torch.bfloat16))
    buffer = torch.zeros(6, 4)
    # No grad_added_to_main_grad: megatron then returns no dummy (whose device would be CUDA's).
    weight.__fsdp_param__, weight.main_grad, weight.get_main_grad = True, buffer, lambda: buffer
    weight._gbuf = types.SimpleNamespace(is_data_distributed=False)
    expected = torch.zeros(6, 4, dtype=torch.float64)
    for _ in range(2):
        x = torch.randn(5, 4, generator=gen).to(torch.bfloat16).requires_grad_()
        grad_out = torch.randn(5, 6, generator=gen).to(torch.bfloat16)
        try:
            layers.linear_with_grad_accumulation_and_async_allreduce(
                x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False,
                sequence_parallel=False).backward(grad_out)
        except RuntimeError as exc:
            if "dtype" in str(exc):
                return False
            raise
        expected += grad_out.double().t() @ x.detach().double()
    return bool(torch.allclose(buffer.double(), expected, rtol=1e-2, atol=1e-2))


def _apex_runs_patched(layers: types.ModuleType) -> bool:
    """The apex extension ``layers`` calls in its wgrad path: True where it is there and adds
    ``grad_output^T @ input`` into main_grad (gemm_patch's stand-in); False where it is missing."""
    import torch

    extension = vars(layers).get("fused_weight_gradient_mlp_cuda")
    if extension is None or not vars(layers).get("_grad_accum_fusion_available"):
        return False
    total_input, grad_output = torch.ones(3, 4, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16)
    main_grad = torch.ones(2, 4)
    extension.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    return bool(torch.equal(main_grad, torch.full((2, 4), 4.0)))


# Per target, megatron's code run through a module object it can reach: True where it behaves
# patched. Every target is also checked by identity at each place its install assigned.
RUNS_PATCHED = {"fsdp-wgrad": _wgrad_runs_patched, "fsdp-wgrad-gemm": _wgrad_runs_patched,
                "apex-wgrad": _apex_runs_patched}


def _is_gemm_patch_object(target: Target, value: Any, step: Step) -> bool:
    marked = getattr(value, "_self_gemm_patch_target", None) or getattr(value, "_gemm_patch_target", None)
    return marked == target.name or (not callable(value) and value is step.installed)


class Reachable:
    """What megatron can reach of a target's patch: the places its first install assigned (the
    objects megatron's code imported then: module objects, classes), and the same places in the
    module objects and classes imported now (after a fresh import or a reload)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.first = [step for step in steps(target) if not step.is_item]
        self.modules: list[types.ModuleType] = [sys.modules[target.module]]
        assert self.first, f"{target.name}: nothing installed to follow"

    def places(self) -> list[tuple[Any, Step]]:
        found: list[tuple[Any, Step]] = []
        for step in self.first:
            owner = step.owner
            if isinstance(owner, types.ModuleType):
                now = sys.modules.get(owner.__name__)
            else:
                now = vars(sys.modules.get(owner.__module__) or types.ModuleType("-")).get(owner.__name__)
            for place in (owner, now):
                if place is not None and not any(p is place and s.name == step.name for p, s in found):
                    found.append((place, step))
        return found

    def check(self, when: str) -> None:
        """Every reachable place holds gemm_patch's object, and megatron's code run through each
        module object behaves patched, exactly where status() says the target is patched."""
        live = sys.modules.get(self.target.module)
        if live is not None and not any(m is live for m in self.modules):
            self.modules.append(live)
        st = state_of(self.target.name)
        want = st.state in PATCHED_STATES
        wrong = [f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{step.name}"
                 for owner, step in self.places()
                 if _is_gemm_patch_object(self.target, vars(owner).get(step.name), step) != want]
        runs = RUNS_PATCHED.get(self.target.name)
        if runs is not None:
            wrong += [f"megatron's code through {m.__name__} module object {i}"
                      for i, m in enumerate(self.modules) if runs(m) != want]
        assert not wrong, (f"after {when}: status says {st.state} ({st.reason}), but these are "
                           f"{'not ' if want else ''}patched: {wrong}")


def check_reachable_after_sequences(target: Target, expect: str) -> None:
    """After a fresh import (``del sys.modules``), ``importlib.reload``, revert() and apply() in
    turn, and a reload of each other module its install patched followed by apply(), what
    megatron can reach is patched exactly where status() says so."""
    if not patched(expect):
        pytest.skip(f"{target.name} is {expect} here: nothing installed to follow")
    with only(target):
        first = import_module(target)
        parent_name, _, short = target.module.rpartition(".")
        parent = sys.modules.get(parent_name)
        gemm_patch.apply()
        reachable = Reachable(target)
        names = {getattr(step.owner, "__module__", None) for step in reachable.first} - {target.module, None}
        others = [sys.modules[name] for name in sorted(names) if name in sys.modules]
        gemm_patch.revert()
        unpatched = [(module, dict(vars(module))) for module in others]  # put back afterwards
        gemm_patch.apply()
        reachable.check("apply()")
        del sys.modules[target.module]
        try:
            fresh = importlib.import_module(target.module)
            reachable.check("del sys.modules[...] and a fresh import")
            gemm_patch.revert()
            reachable.check("revert()")
            gemm_patch.apply()
            reachable.check("revert() and apply() after the fresh import")
            importlib.reload(fresh)
            reachable.check("importlib.reload")
            gemm_patch.revert()
            gemm_patch.apply()
            reachable.check("importlib.reload, revert() and apply()")
            for module in others:
                importlib.reload(module)
                gemm_patch.apply()
                reachable.check(f"importlib.reload({module.__name__}) and apply()")
        finally:
            gemm_patch.revert()
            for module, contents in unpatched:
                vars(module).clear()
                vars(module).update(contents)
            sys.modules[target.module] = first
            if parent is not None:
                setattr(parent, short, first)
            forget(target.module, keep=first)


def check_states_before_import(component: str, expected: dict[str, str]) -> None:
    """While its module is not imported, each target of ``component`` reads what its import
    will make it read (``pending`` only where it will be patched), and a target turned off
    reads ``off`` (or ``not applicable``, with no such module) at once, never ``pending``. One
    check for the component: with the modules out of sys.modules nothing is patched, so the
    targets need not be applied one at a time."""
    targets = targets_of(component)
    names = sorted({t.module for t in targets})
    gemm_patch.revert()
    modules = {name: sys.modules.pop(name, None) for name in names}
    remembered = getattr(patcher._state, "seen", {})  # the module objects the patcher patches again
    seen = {name: remembered.pop(name, None) for name in names}
    try:
        gemm_patch.apply()
        states = {t.name: state_of(t.name) for t in targets}
        wrong = {name: st for name, st in states.items()
                 if st.state != (PENDING if patched(expected[name]) else expected[name])}
        assert not wrong, wrong
        for_all = {"GEMM_PATCH_DISABLE": ",".join(t.name for t in REGISTRY)}
        switches = {t.switch_variable: "0" if t.default_on else None for t in targets}
        for variables in (for_all, switches):
            gemm_patch.revert()
            with environ(**variables):
                gemm_patch.apply()
                for target in targets:
                    st = state_of(target.name)
                    allowed = (OFF,) if modules[target.module] is not None else (OFF, NOT_APPLICABLE)
                    assert st.state in allowed, (variables, st)
    finally:
        gemm_patch.revert()
        for name in names:
            if modules[name] is not None:
                sys.modules[name] = modules[name]
            if seen[name] is not None:
                remembered[name] = seen[name]
        gemm_patch.apply()


def check_replaced(target: Target, expect: str) -> None:
    if not patched(expect):
        pytest.skip(f"{target.name} is {expect} here: nothing installed to replace")
    with only(target):
        import_module(target)
        gemm_patch.apply()
        step = next(s for s in steps(target) if not s.is_item)
        foreign = types.SimpleNamespace(put_there_by="someone else")
        setattr(step.owner, step.name, foreign)
        try:
            st = state_of(target.name)
            assert st.state == REPLACED, st.reason
            reverted = gemm_patch.revert()
            assert vars(step.owner)[step.name] is foreign, "revert() leaves another's object where it is"
            assert {t.name: t for t in reverted.targets}[target.name].state == REPLACED
        finally:
            step.restore()


def check_unknown_code(target: Target, expect: str, strict: bool) -> None:
    unknown = tuple(dataclasses.replace(t, fingerprints={}) if t.name == target.name else t for t in REGISTRY)
    # The gate closed, also where compat/adopt.py runs the tests with it open for new code.
    with only(target, registry=unknown), environ(GEMM_PATCH_ALLOW_UNVERIFIED=None):
        import_module(target)
        before = Snapshot(scope_modules(target))
        if strict and patched(expect):
            with pytest.raises(gemm_patch.GemmPatchError):
                gemm_patch.apply(strict=True)
        else:
            gemm_patch.apply(strict=strict)
            want = UNVERIFIED if patched(expect) else NOT_APPLICABLE
            assert state_of(target.name).state == want, state_of(target.name).reason
        assert not before.changed(), describe(before.changed(), before)
        assert not steps(target)


def check_fixed_upstream(target: Target, expect: str) -> None:
    """This release's code recorded as fixed upstream (``Target.fixed_upstream``) instead of
    verified: not applicable, nothing installed, also in strict mode."""
    if not patched(expect):
        pytest.skip(f"{target.name} is {expect} here")
    import_module(target)
    gemm_patch.apply()
    fingerprint = state_of(target.name).fingerprint  # of this release's code, as judged
    assert fingerprint, state_of(target.name)
    fixed = tuple(dataclasses.replace(t, fingerprints={}, fixed_upstream={fingerprint: "upstream's own fix"})
                  if t.name == target.name else t for t in REGISTRY)
    with only(target, registry=fixed):
        before = Snapshot(scope_modules(target))
        gemm_patch.apply(strict=True)
        st = state_of(target.name)
        assert st.state == NOT_APPLICABLE and "fixed upstream (upstream's own fix)" in st.reason, st.reason
        assert not before.changed(), describe(before.changed(), before)
        assert not steps(target)


def check_disable(target: Target, expect: str) -> None:
    gemm_patch.revert()
    try:
        module = import_module(target)
        before = Snapshot(scope_modules(target))
        with environ(GEMM_PATCH_DISABLE=target.name):
            gemm_patch.apply()
            st = state_of(target.name)
            if module is None:
                assert st.state == NOT_APPLICABLE, st.reason
            else:
                assert st.state == OFF and "GEMM_PATCH_DISABLE" in st.reason, st.reason
            assert not steps(target)
            others = {p for t in REGISTRY if t is not target for p in places(steps(t))}
            assert before.changed() <= others, describe(before.changed() - others, before)
    finally:
        gemm_patch.revert()
        gemm_patch.apply()


def check_not_applicable(target: Target, expect: str) -> None:
    if expect != NOT_APPLICABLE:
        pytest.skip(f"{target.name} is {expect} here")
    gemm_patch.revert()
    try:
        import_module(target)
        before = Snapshot(scope_modules(target))
        gemm_patch.apply()
        assert state_of(target.name).state == NOT_APPLICABLE, state_of(target.name).reason
        assert not steps(target)
        others = {p for t in REGISTRY if t is not target for p in places(steps(t))}
        assert before.changed() <= others, describe(before.changed() - others, before)
    finally:
        gemm_patch.revert()
        gemm_patch.apply()


# An instance megatron builds through a target's module (``build(module)``, in whatever the
# component's ``around`` sets up), returned as a function that trains through it with megatron's
# own code and says whether the result is the patched one.
Build = Callable[[types.ModuleType], Callable[[], bool]]


def check_built_before_apply(target: Target, expect: str, build: Build | None,
                             around: Callable[[], contextlib.AbstractContextManager]) -> None:
    """No order of building and importing leaves a model on megatron's own code where gemm-patch
    would fix it: for a target that patches what megatron runs once per instance, when it is
    built (``Target.built_classes``), one instance built while the target is not applied and one
    built after, both trained through megatron's own code after apply(). Both must train patched,
    and status say so (0.5.0 reported the earlier one as bypassed and left it on megatron's
    hooks)."""
    if not patched(expect):
        pytest.skip(f"{target.name} is {expect} here")
    module = import_module(target)
    gemm_patch.apply()
    installs = patcher._state.installs.get(target.name, [])
    classes = [c for install in installs for c in target.built_classes(install.undo)]
    if not classes:
        return  # megatron looks this patch up at every call: what it reaches is checked above
    if build is None:
        pytest.skip(f"no harness in this folder builds a {classes[0].__name__}")
    with around():
        gemm_patch.revert()
        try:
            with environ(GEMM_PATCH_DISABLE=target.name):  # every other fix there (apex's stand-in too)
                gemm_patch.apply()
                early = build(module)
        finally:
            gemm_patch.revert()
            gemm_patch.apply()
        late = build(module)
        st = state_of(target.name)
        assert late(), f"{target.name}: an instance built after apply() trained as megatron's own code does"
        assert early() and st.state in PATCHED_STATES, (
            f"{target.name} says {st.state}: an instance built before apply() was not brought under the patch "
            f"({st.reason})")
        del early, late
        gc.collect()  # what the instances hold in cycles: no later check finds them


def define_tests(namespace: dict, component: str, expected: dict[str, str], built: Mapping[str, Build] | None = None,
                 around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
    """The contract's test functions for ``component``'s targets, put into a test module's
    ``namespace`` (each test folder runs them against its own release). ``built``: per target
    name, how megatron's code builds what that target patches at build (``Build``), run inside
    ``around()``."""
    targets = params(component)
    by_target = pytest.mark.parametrize("target", targets)

    def expect(target) -> str:
        return expected[target.name]

    @pytest.mark.common_machinery  # a fresh process per order; in-process, the re-import covers it
    @pytest.mark.parametrize("order", ["gemm_patch first", "module first"])
    @by_target
    def test_import_order(target, order):
        check_import_order(target, expect(target), order, component)

    @by_target
    def test_apply_revert_apply(target):
        check_apply_revert_apply(target, expect(target))

    @by_target
    def test_reload_keeps_it_patched(target):
        check_reload(target, expect(target))

    @by_target
    def test_reimport_patches_the_new_module_and_keeps_the_old(target):
        check_reimport(target, expect(target))

    @by_target
    def test_what_megatron_reaches_is_patched_iff_status_says_so(target):
        check_reachable_after_sequences(target, expect(target))

    def test_states_before_the_import_agree_and_off_is_never_pending():
        check_states_before_import(component, expected)

    @by_target
    def test_replaced_object_is_left_alone(target):
        check_replaced(target, expect(target))

    @pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
    @by_target
    def test_unknown_code_is_left_alone(target, strict):
        check_unknown_code(target, expect(target), strict)

    @by_target
    def test_code_fixed_upstream_is_not_applicable(target):
        check_fixed_upstream(target, expect(target))

    @by_target
    def test_disable_leaves_it_off(target):
        check_disable(target, expect(target))

    @by_target
    def test_not_applicable_changes_nothing(target):
        check_not_applicable(target, expect(target))

    @by_target
    def test_nothing_built_before_apply_runs_upstream_code_while_status_says_patched(target):
        check_built_before_apply(target, expect(target), (built or {}).get(target.name), around)

    namespace.update({name: value for name, value in locals().items() if name.startswith("test_")})
