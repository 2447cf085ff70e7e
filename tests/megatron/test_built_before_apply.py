# ruff: noqa: F811  (pytest fixtures imported from test_shared_weights are the test functions' parameters)
"""A MegatronFSDP built before ``gemm_patch.apply()`` (a model built, then ``import gemm_patch``).

Megatron-FSDP registers its hooks as closures in ``MegatronFSDP.__init__``: an instance built
before the patch holds megatron's own nested functions whatever the class holds later. Under
gradient-accumulation fusion those hooks drop the tied embedding's other gradient (what
fsdp-shared-grad fixes). ``apply()`` brings such an instance under the patch: the nested
functions the twin edits are swapped where its hooks hold them (the hooks keep their places),
and ``revert()`` puts megatron's own back. An instance whose hooks were made by other code (a
fork's own copy of the method) cannot be: the target reads ``bypassed`` with one WARNING while
it lives, and strict mode refuses it.

The harness is test_shared_weights' (megatron's real layers and the release's real hooks);
``apex-wgrad``'s stand-in plays apex, present while the layers are built.
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import re
import textwrap
import types

import pytest
from conftest import torch
from test_shared_weights import (  # noqa: F401  (fixtures: fsdp, parallel, cpu_dummy_wgrad)
    BUFFERS,
    PATCHED,
    TOL,
    TiedLM,
    _micro_batches,
    cpu_dummy_wgrad,
    expected_state,
    fsdp,
    needs_code,
    parallel,
    per_module_call_hooks,
    rel,
    remove_hooks,
    run,
    wrap,
)

import gemm_patch
from gemm_patch.engine import patcher
from gemm_patch.targets.shared_grad import hook_places

pytestmark = pytest.mark.proves("fsdp-shared-grad", "mfsdp-shared-grad")

MTP = [pytest.param(False, id="tied"), pytest.param(True, id="tied_mtp")]
WORDS = "built before gemm_patch.apply()"


def state(name: str):
    return {t.name: t for t in gemm_patch.status().targets}[name]


@pytest.fixture(autouse=True)
def collected():
    """Each test's instances collected after it (with their hooks removed they are garbage in
    a cycle): a later apply() must not find them."""
    yield
    gc.collect()


@pytest.fixture
def warnings(caplog, monkeypatch):
    """The gemm_patch logger's records (its own handler, propagate off), each warning fresh."""
    monkeypatch.setattr(patcher._state, "warned", set())
    log = logging.getLogger("gemm_patch")
    log.addHandler(caplog.handler)
    yield lambda: [r for r in caplog.records if WORDS in r.getMessage()]
    log.removeHandler(caplog.handler)


def build_unpatched(build):
    """``build()`` while nothing is applied (the model built before ``import gemm_patch``),
    then ``apply()``; returns what it built."""
    gemm_patch.revert()
    try:
        return build()
    finally:
        gemm_patch.apply()


def own_copy(module) -> type:
    """A subclass of the release's MegatronFSDP whose ``_register_fsdp_hooks`` is its own copy,
    compiled from megatron's source (a fork's class): code gemm-patch has not verified, whose
    hooks are not made from the method the twin was built from."""
    original = inspect.unwrap(vars(module.MegatronFSDP)["_register_fsdp_hooks"])
    namespace: dict = {}
    source = textwrap.dedent(inspect.getsource(original))
    exec(compile(source, inspect.getsourcefile(original), "exec"), vars(module), namespace)
    return type("ForkedFSDP", (module.MegatronFSDP,), {"_register_fsdp_hooks": namespace["_register_fsdp_hooks"]})


def hook_layout(obj) -> list:
    """Every hook dict the instance's hooks live in, as (where, key, the object held), in order;
    and every nested function its closures reach, by cell: what swapping must keep in place."""
    places = hook_places(obj)
    held = [(i, key, value) for i, place in enumerate(places) for key, value in place.items()
            if callable(value) and not isinstance(value, torch.nn.Module)]
    cells, todo, seen = [], [value for _, _, value in held], set()
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, functools.partial):
            todo += [item.func, *item.args]
        for cell in getattr(item, "__closure__", None) or ():
            try:
                contents = cell.cell_contents
            except ValueError:
                continue
            if isinstance(contents, types.FunctionType):
                cells.append(("cell", id(cell), contents))
                todo.append(contents)
    return held + sorted(set(cells), key=lambda c: c[1])


EDITED = ("_grad_acc", "_post_backward", "_register_post_backward_hook")  # what the twin changes (0.14-0.15: all)


def twin_edits(obj) -> list[str]:
    """The twin's versions of the nested functions it changes, among those the hooks reach (an
    instance built under the twin also holds its other nested functions, compiled from
    megatron's source unchanged)."""
    return [name for name in twin_functions(obj) if name.rsplit(".", 1)[-1] in EDITED]


def twin_functions(obj) -> list[str]:
    """The qualified names of the twin's nested functions among those the instance's hooks reach."""
    found = {f.__qualname__ for _, _, held in hook_layout(obj) for f in (held, getattr(held, "func", None))
             if isinstance(f, types.FunctionType) and "__gemm_patch_factory__" in f.__qualname__}
    return sorted(found)


def switch_off_and_train(target, module, model, obj, monkeypatch) -> None:
    """The target switched off at a later apply() (fsdp-wgrad kept), then megatron's behaviour
    checked: the tied embedding's lookup gradient lost on 0.16+ (0.14-0.15 fail loudly on the
    tied weight argument, test_shared_weights: not trained there)."""
    monkeypatch.setenv(target.switch, "0")
    gemm_patch.apply()
    if not per_module_call_hooks(target, module):
        _, got, ref, _ = _micro_batches(model, obj, 2, 0, True)
        assert rel(got["embedding.weight"], ref["embedding.weight"]) > 0.2


@needs_code
@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("mtp", MTP)
def test_a_megatron_fsdp_built_before_apply_is_brought_under_the_patch(parallel, fsdp, mtp, distributed, warnings):
    """0.5.0 reported it (``bypassed``) and it lost the tied embedding's gradient (0.669)."""
    target, module = fsdp
    torch.manual_seed(0)
    model = TiedLM(tied=True, mtp=mtp)
    gemm_patch.revert()
    early = wrap(module, model, distributed)
    before = hook_layout(early)
    assert not twin_functions(early)
    gemm_patch.apply()
    st = state(target.name)
    assert st.state in PATCHED, (st.state, st.reason)
    assert not warnings()
    after = hook_layout(early)
    # Every hook in its place, the same objects, except the nested functions the twin edits;
    # the twin's own cells (gemm_patch's functions) are reached besides megatron's
    now = {(i, key): held for i, key, held in after}
    assert [(i, key) for i, key, _ in before] == [(i, key) for i, key, _ in after if (i, key) in
                                                  {(j, k) for j, k, _ in before}]
    extra = [held for i, key, held in after if i == "cell" and (i, key) not in {(j, k) for j, k, _ in before}]
    assert all(fn.__module__.startswith("gemm_patch.") for fn in extra), extra
    changed = sorted({getattr(b, "__name__", getattr(getattr(b, "func", None), "__name__", "?"))
                      for i, key, b in before if now[(i, key)] is not b})
    edited = ["_grad_acc", "_post_backward", "_register_post_backward_hook"] \
        if per_module_call_hooks(target, module) else ["_grad_acc"]
    assert changed and set(changed) <= set(edited), changed
    assert twin_functions(early)

    _, got, ref, _ = run(model, early)
    errors = {name: rel(got[name], ref[name]) for name in got}
    assert all(error < TOL for error in errors.values()), errors
    assert state(target.name).state in PATCHED and not warnings()


@needs_code
@pytest.mark.parametrize("distributed", BUFFERS)
def test_the_apply_after_one_made_inside_a_backward_brings_the_instance_under(parallel, fsdp, distributed, warnings):
    """``apply()`` inside a backward (a hook calls it) leaves a MegatronFSDP built before it on
    megatron's hooks, since the backward running was judged under them: ``bypassed``. The next
    ``apply()`` outside a backward brings it under (0.5.0 kept it bypassed until revert() and
    apply(), and it lost the tied embedding's lookup gradient)."""
    target, module = fsdp
    torch.manual_seed(0)
    model = TiedLM(tied=True)
    gemm_patch.revert()
    early = wrap(module, model, distributed)
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: gemm_patch.apply() and None)
    y.sum().backward()
    st = state(target.name)
    assert st.state == "bypassed" and f"1 MegatronFSDP {WORDS}" in st.reason, (st.state, st.reason)
    assert not twin_functions(early)
    gemm_patch.apply()
    assert state(target.name).state in PATCHED and twin_functions(early), state(target.name)
    _, got, ref, _ = run(model, early)
    errors = {name: rel(got[name], ref[name]) for name in got}
    assert all(error < TOL for error in errors.values()), errors
    assert state(target.name).state in PATCHED


@needs_code
def test_revert_puts_an_instance_brought_under_back_on_megatrons_hooks(parallel, fsdp, warnings, monkeypatch):
    """Exact undo, by revert() and by the target switched off at a later apply(): every hook
    dict and closure cell holds megatron's own objects again, status reads plainly off, and
    megatron's behaviour is back (the tied embedding's gradient lost on 0.16+; 0.14-0.15 fail
    loudly on the tied weight argument, test_shared_weights)."""
    target, module = fsdp
    torch.manual_seed(0)
    model = TiedLM(tied=True)
    gemm_patch.revert()
    early = wrap(module, model, False)
    before = hook_layout(early)

    def megatrons_own() -> bool:
        after = hook_layout(early)
        return len(after) == len(before) and all(a[1] == b[1] and a[2] is b[2]
                                                 for a, b in zip(after, before, strict=True))

    try:
        gemm_patch.apply()
        assert twin_functions(early) and state(target.name).state in PATCHED
        gemm_patch.revert()
        assert megatrons_own() and not twin_functions(early)
        st = state(target.name)
        assert st.state == "off" and "built under the patch" not in st.reason, st.reason
        gemm_patch.apply()  # under the patch again
        assert twin_functions(early) and state(target.name).state in PATCHED
        switch_off_and_train(target, module, model, early, monkeypatch)  # checks megatron's behaviour
        assert megatrons_own() and state(target.name).state == "off"
    finally:
        monkeypatch.delenv(target.switch)
        gemm_patch.apply()
        remove_hooks(early)


@needs_code
@pytest.mark.parametrize("distributed", BUFFERS)
def test_a_megatron_fsdp_of_other_code_built_before_apply_reads_bypassed(parallel, fsdp, distributed, warnings):
    target, module = fsdp
    gemm_patch.apply()
    torch.manual_seed(0)
    model = TiedLM(tied=True)
    early = build_unpatched(lambda: wrap(module, model, distributed, cls=own_copy(module)))
    st = state(target.name)
    assert st.state == "bypassed", (st.state, st.reason)
    assert f"1 ForkedFSDP {WORDS}" in st.reason and "gemm-patch run" in st.reason, st.reason
    found = warnings()
    assert len(found) == 1 and found[0].levelno == logging.WARNING, [r.getMessage() for r in found]
    assert "GEMM_PATCH_AUTO=1" in found[0].getMessage()
    assert not twin_functions(early)

    # What the state names: megatron's own hooks lose the embedding lookup's gradient. On
    # megatron-core 0.14-0.15 they fail loudly instead (test_shared_weights), and a failed
    # backward leaves the instance held by autograd's graph: not trained here.
    if per_module_call_hooks(target, module):
        remove_hooks(early)
    else:
        _, got, ref, _ = run(model, early)
        assert rel(got["embedding.weight"], ref["embedding.weight"]) > 0.2
        del _
    assert state(target.name).state == "bypassed" and len(warnings()) == 1

    early = model = None  # the lambda above holds the name, not the model
    gc.collect()
    assert state(target.name).state == expected_state(target)  # nothing left that runs upstream's hooks


@needs_code
@pytest.mark.parametrize("distributed", BUFFERS)
def test_hooks_bound_before_apply_are_found_at_the_first_backward(parallel, fsdp, distributed, warnings):
    """A subclass (a framework's wrapper) that bound megatron's method in its own class body
    before the patch: its instances, built after ``apply()``, still register upstream's hooks.
    The first fused write into one of their parameters makes the patcher look again (an
    untied output layer: on megatron-core 0.14-0.15 upstream's hooks fail on a tied one first)."""
    target, module = fsdp

    def subclass():
        class BoundEarly(module.MegatronFSDP):
            _register_fsdp_hooks = module.MegatronFSDP._register_fsdp_hooks

        return BoundEarly

    bound_early = build_unpatched(subclass)
    torch.manual_seed(0)
    model = TiedLM(tied=False)
    obj = wrap(module, model, distributed, cls=bound_early)
    gc.collect()  # an earlier test's instance, its hooks removed, is garbage in a cycle
    assert state(target.name).state in PATCHED  # nothing has met this one yet
    run(model, obj)
    st = state(target.name)
    assert st.state == "bypassed" and f"1 BoundEarly {WORDS}" in st.reason, (st.state, st.reason)
    assert len(warnings()) == 1


@needs_code
def test_strict_mode_refuses_a_megatron_fsdp_built_before_apply(parallel, fsdp, warnings):
    target, module = fsdp
    gemm_patch.apply()
    torch.manual_seed(0)
    model = TiedLM(tied=True)
    early = build_unpatched(lambda: wrap(module, model, True, cls=own_copy(module)))
    gemm_patch.revert()
    try:
        refused = re.escape(f"{target.name}: 1 ForkedFSDP {WORDS}") + ".*GEMM_PATCH_STRICT=1"
        with pytest.raises(gemm_patch.GemmPatchError, match=refused):
            gemm_patch.apply(strict=True)
    finally:
        gemm_patch.revert()
        gemm_patch.apply()
        remove_hooks(early)


@needs_code
@pytest.mark.parametrize("how", ["argument", "variable"])
def test_strict_mode_refuses_at_a_second_apply_while_one_is_bypassed(parallel, fsdp, warnings, monkeypatch, how):
    """Applied already, a MegatronFSDP built before reads ``bypassed``; ``apply(strict=True)``
    (or ``GEMM_PATCH_STRICT=1`` and ``apply()``) then raises, as strict mode says, instead of
    returning a status that reads strict and bypassed at once (0.5.0)."""
    target, module = fsdp
    gemm_patch.apply()
    torch.manual_seed(0)
    model = TiedLM(tied=True)
    early = build_unpatched(lambda: wrap(module, model, True, cls=own_copy(module)))
    try:
        assert state(target.name).state == "bypassed"
        refused = re.escape(f"{target.name}: 1 ForkedFSDP {WORDS}") + ".*GEMM_PATCH_STRICT=1"
        with pytest.raises(gemm_patch.GemmPatchError, match=refused):
            if how == "argument":
                gemm_patch.apply(strict=True)
            else:
                monkeypatch.setenv("GEMM_PATCH_STRICT", "1")
                gemm_patch.apply()
    finally:
        monkeypatch.delenv("GEMM_PATCH_STRICT", raising=False)
        gemm_patch.revert()
        gemm_patch.apply()
        remove_hooks(early)


@needs_code
def test_revert_puts_an_instance_built_under_the_patch_on_megatrons_hooks(parallel, fsdp, warnings, monkeypatch):
    """revert() puts megatron's method back and, in a MegatronFSDP built under the patch, the
    nested functions its build made from the twin: swapped for ones made from megatron's code,
    over the same cells and in the same places, so it runs what status says (0.5.0 left the
    twin's hooks running while status read "reverted"). apply() brings it under again."""
    target, module = fsdp
    gemm_patch.apply()
    torch.manual_seed(0)
    model = TiedLM(tied=True)
    obj = wrap(module, model, False)
    built = hook_layout(obj)
    try:
        assert twin_edits(obj)
        gemm_patch.revert()
        st = state(target.name)
        assert st.state == "off" and "built under the patch" not in st.reason, st.reason
        assert not twin_edits(obj) and not any(k is obj for k in target.kept_patched())
        after = hook_layout(obj)
        hooks = [(i, key) for i, key, _ in after if i != "cell"]
        assert hooks == [(i, key) for i, key, _ in built if i != "cell"]  # every hook in its place
        gemm_patch.apply()
        assert twin_edits(obj) and state(target.name).state in PATCHED
        switch_off_and_train(target, module, model, obj, monkeypatch)  # checks megatron's behaviour
        assert not twin_edits(obj) and state(target.name).state == "off"
    finally:
        monkeypatch.delenv(target.switch)
        gemm_patch.apply()
        remove_hooks(obj)


@needs_code
def test_an_instance_built_under_the_patch_trains_patched_after_revert_and_apply(parallel, fsdp, distributed=True):
    target, module = fsdp
    gemm_patch.apply()
    torch.manual_seed(0)
    model = TiedLM(tied=True, mtp=True)
    obj = wrap(module, model, distributed)
    gemm_patch.revert()
    gemm_patch.apply()
    _, got, ref, _ = run(model, obj)
    errors = {name: rel(got[name], ref[name]) for name in got}
    assert all(error < TOL for error in errors.values()), errors


@needs_code
def test_a_fault_while_swapping_never_takes_apply_or_revert_down(parallel, fsdp, warnings, monkeypatch):
    """Bringing an instance under the patch or putting it back fails (a hook holding something
    unexpected): apply() still returns, the instance reads bypassed; revert() still returns and
    status names the instance that keeps the patch."""
    from gemm_patch.targets import shared_grad as target_module

    target, module = fsdp

    def broken(*args, **kwargs):
        raise RuntimeError("a hook gemm-patch cannot read")

    torch.manual_seed(0)
    model = TiedLM(tied=True)
    gemm_patch.revert()
    early = wrap(module, model, False)
    late = None
    try:
        with monkeypatch.context() as m:
            m.setattr(target_module, "swap_in", broken)
            gemm_patch.apply()
            st = state(target.name)
            assert st.state == "bypassed" and f"1 MegatronFSDP {WORDS}" in st.reason, st.reason
            remove_hooks(early)
            early = model = None
            gc.collect()
            torch.manual_seed(0)
            model = TiedLM(tied=True)
            late = wrap(module, model, False)  # built under the patch
            gemm_patch.revert()
            st = state(target.name)
            assert st.state == "off" and "1 MegatronFSDP built under the patch keeps running it" in st.reason, st
    finally:
        gemm_patch.apply()
        for obj in (early, late):
            if obj is not None:
                remove_hooks(obj)
