# ruff: noqa: F811  (pytest fixtures imported from test_shared_weights are the test functions' parameters)
"""A MegatronFSDP built before ``gemm_patch.apply()`` (a model built, then ``import gemm_patch``).

Megatron-FSDP registers its hooks as closures in ``MegatronFSDP.__init__``: an instance built
before the patch keeps megatron's own hooks whatever the class holds later. Under
gradient-accumulation fusion those hooks drop the tied embedding's other gradient (what
fsdp-shared-grad fixes), so such an instance must never train while fsdp-shared-grad reads
``verified``: the patcher finds it at ``apply()``, or at the first fused write into a parameter
no twin's hooks handle, and the target reads ``bypassed`` with one WARNING while it lives.

The harness is test_shared_weights' (megatron's real layers and the release's real hooks);
``apex-wgrad``'s stand-in plays apex, present while the layers are built.
"""

from __future__ import annotations

import gc
import logging
import re
import weakref

import pytest
from conftest import torch
from test_shared_weights import (  # noqa: F401  (fixtures: fsdp, parallel, cpu_dummy_wgrad)
    BUFFERS,
    PATCHED,
    TOL,
    TiedLM,
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


@needs_code
@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("mtp", MTP)
def test_a_megatron_fsdp_built_before_apply_reads_bypassed(parallel, fsdp, mtp, distributed, warnings):
    target, module = fsdp
    gemm_patch.apply()
    torch.manual_seed(0)
    model = TiedLM(tied=True, mtp=mtp)
    early = build_unpatched(lambda: wrap(module, model, distributed))
    st = state(target.name)
    assert st.state == "bypassed", (st.state, st.reason)
    assert f"1 MegatronFSDP {WORDS}" in st.reason and "gemm-patch run" in st.reason, st.reason
    found = warnings()
    assert len(found) == 1 and found[0].levelno == logging.WARNING, [r.getMessage() for r in found]
    assert "GEMM_PATCH_AUTO=1" in found[0].getMessage()

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

    del early, model
    gc.collect()
    assert state(target.name).state == expected_state(target)  # nothing left that runs upstream's hooks

    torch.manual_seed(0)
    model = TiedLM(tied=True, mtp=mtp)
    _, got, ref, obj = run(model, wrap(module, model, distributed))
    errors = {name: rel(got[name], ref[name]) for name in got}
    assert all(error < TOL for error in errors.values()), errors
    assert state(target.name).state in PATCHED


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
    early = build_unpatched(lambda: wrap(module, model, True))
    gemm_patch.revert()
    try:
        refused = re.escape(f"{target.name}: 1 MegatronFSDP {WORDS}") + ".*GEMM_PATCH_STRICT=1"
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
    early = build_unpatched(lambda: wrap(module, model, True))
    try:
        assert state(target.name).state == "bypassed"
        refused = re.escape(f"{target.name}: 1 MegatronFSDP {WORDS}") + ".*GEMM_PATCH_STRICT=1"
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
def test_revert_names_an_instance_built_under_the_patch_that_keeps_running_it(parallel, fsdp):
    """revert() puts megatron's method back, but a MegatronFSDP built under the patch keeps the
    hooks its build registered (closures of that call: swapping them would change their order
    among the host's hooks). Status says so, and it is true: the hooks that instance runs are the
    twin's. Once the instance is gone, status reads plainly off (0.5.0 read
    "reverted" alone while the instance ran the fix)."""
    target, module = fsdp
    gemm_patch.apply()
    torch.manual_seed(0)
    model = TiedLM(tied=True)
    obj = wrap(module, model, False)
    try:
        gemm_patch.revert()
        st = state(target.name)
        kept = target.kept_patched()  # this one, and any an earlier test left alive
        assert st.state == "off" and any(k is obj for k in kept), st
        count = f"{len(kept)} MegatronFSDP built under the patch keep{'s' if len(kept) == 1 else ''} running it"
        assert count in st.reason, st.reason
        del kept
        # The closures its build registered (module hooks; 0.16+ also per-parameter hooks).
        hooks = [getattr(h, "func", h) for m in model.modules() for h in m._forward_pre_hooks.values()]
        hooks += [h for p in model.parameters() for h in (p._post_accumulate_grad_hooks or {}).values()]
        built = [h for h in hooks if "_register_fsdp_hooks" in getattr(h, "__qualname__", "")]
        assert built and all("__gemm_patch_factory__" in h.__qualname__ for h in built), \
            "the instance's hooks are gemm-patch's twin"
    finally:
        gemm_patch.apply()
        remove_hooks(obj)
    gone = weakref.ref(obj)
    del obj, model, hooks, built
    gc.collect()
    assert gone() is None
    gemm_patch.revert()
    try:
        left = len(target.kept_patched())
        reason = state(target.name).reason
        named = f"{left} MegatronFSDP built under the patch" in reason
        assert named if left else "built under the patch" not in reason, reason
    finally:
        gemm_patch.apply()
