"""fsdp-shared-grad's gate and edit on synthetic modules (no megatron needed): the statement of
the nested ``_grad_acc`` it changes, what it leaves alone, and ``add_shared_grad``'s rule.
The behaviour on every real release is tested in tests/megatron/test_shared_weights.py."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from source_modules import load_source

from gemm_patch.engine import config
from gemm_patch.engine.callsite import CallSiteError
from gemm_patch.targets import shared_grad

SOURCE = '''
def to_local_if_dtensor(tensor):
    return tensor


class MegatronFSDP:
    def _register_fsdp_hooks(self, root_module):
        def _grad_acc(param):
            if not param.grad_added_to_main_grad:
                if param.grad is not None:
                    param.main_grad = param.get_main_grad()
                    param.main_grad.add_(to_local_if_dtensor(param.grad))
                    del param.grad

            if param.grad_added_to_main_grad and param.grad is not None:
                del param.grad

            # Reset the grad accumulate flag.
            param.grad_added_to_main_grad = False

        self.grad_acc = _grad_acc
        return root_module
'''


def target_for(module) -> shared_grad.SharedGradTarget:
    return dataclasses.replace(shared_grad.TARGET, module=module.__name__, fingerprints={})


def param(zero_out_wgrad: bool | None, grad_added: bool = True):
    """A weight after a fused write of 2s into main_grad, with param.grad = 1s on top."""
    p = torch.nn.Parameter(torch.zeros(2, 3))
    main_grad = torch.full((2, 3), 2.0)
    p.get_main_grad = lambda: main_grad
    p.grad = torch.ones(2, 3)
    p.grad_added_to_main_grad = grad_added
    if zero_out_wgrad is not None:
        p.zero_out_wgrad = zero_out_wgrad
    return p, main_grad


@pytest.fixture
def module(tmp_path):
    return load_source(tmp_path, SOURCE, "synthetic_fsdp")


def install(module):
    target = target_for(module)
    found = target.inspect(module)
    assert found.applicable, found.reason
    undo = shared_grad.Undo()
    target.install(module, found, undo, config.Config())
    return undo


def test_original_drops_the_tied_grad_and_the_twin_adds_it(module):
    obj = module.MegatronFSDP()
    obj._register_fsdp_hooks(None)
    p, main_grad = param(zero_out_wgrad=True)
    obj.grad_acc(p)
    assert p.grad is None and torch.equal(main_grad, torch.full((2, 3), 2.0)), "upstream: dropped"

    undo = install(module)
    obj._register_fsdp_hooks(None)
    p, main_grad = param(zero_out_wgrad=True)
    obj.grad_acc(p)
    assert p.grad is None and p.grad_added_to_main_grad is False
    assert torch.equal(main_grad, torch.full((2, 3), 3.0)), "DDP's rule: the other use's grad added"
    assert p.main_grad is main_grad
    assert undo.run() == [] and not hasattr(vars(module.MegatronFSDP)["_register_fsdp_hooks"], "__wrapped__")


@pytest.mark.parametrize("flag", [False, None])
def test_without_zero_out_wgrad_the_dummy_is_dropped_as_upstream(module, flag):
    install(module)
    obj = module.MegatronFSDP()
    obj._register_fsdp_hooks(None)
    p, main_grad = param(zero_out_wgrad=flag)
    obj.grad_acc(p)
    assert p.grad is None and torch.equal(main_grad, torch.full((2, 3), 2.0))


def test_no_fused_write_is_left_to_upstream(module):
    install(module)
    obj = module.MegatronFSDP()
    obj._register_fsdp_hooks(None)
    p, main_grad = param(zero_out_wgrad=True, grad_added=False)
    obj.grad_acc(p)  # upstream's own branch adds param.grad once
    assert torch.equal(main_grad, torch.full((2, 3), 3.0))


def test_the_twin_keeps_file_and_lines_and_adds_no_module_name(module):
    install(module)
    wrapper = vars(module.MegatronFSDP)["_register_fsdp_hooks"]
    twin, original = wrapper._self_gemm_patch_twin, wrapper.__wrapped__
    assert twin.__code__.co_filename == original.__code__.co_filename
    assert twin.__code__.co_firstlineno == original.__code__.co_firstlineno
    assert not hasattr(module, shared_grad.CELL)
    assert wrapper.__name__ == "_register_fsdp_hooks"


@pytest.mark.parametrize("edit, state", [
    # Without the statement or the nested function, unknown code may drop the gradient in another
    # form (``param.grad = None``): unverified, never not applicable on a source match.
    (lambda s: s.replace("            if param.grad_added_to_main_grad and param.grad is not None:\n"
                         "                del param.grad\n", ""), "unverified"),
    (lambda s: s.replace("del param.grad\n\n            #", "param.grad = None\n\n            #"),
     "unverified"),
    (lambda s: s.replace("def _grad_acc(param):", "def _grad_acc2(param):"), "unverified"),
    (lambda s: s.replace("        self.grad_acc = _grad_acc\n",
                         "        def _grad_acc(param):\n            pass\n        self.grad_acc = _grad_acc\n"),
     "skipped"),
    (lambda s: s.replace("def to_local_if_dtensor(tensor):\n    return tensor\n", "to_local_if_dtensor = None\n"),
     "skipped"),
])
def test_other_code_is_left_alone(tmp_path, edit, state):
    module = load_source(tmp_path, edit(SOURCE), "synthetic_fsdp_edited")
    target = target_for(module)
    if state == "skipped":
        with pytest.raises(CallSiteError):
            target.inspect(module)
    else:
        assert not target.inspect(module).applicable
    st, undo = target.patch(module, "1.0", config.load({}))
    assert st.state == state and undo.steps == []
    assert not hasattr(vars(module.MegatronFSDP)["_register_fsdp_hooks"], "__wrapped__")


def test_unknown_fingerprint_is_unverified_and_left_alone(module):
    st, undo = target_for(module).patch(module, "1.0", config.load({}))
    assert st.state == "unverified" and undo.steps == []


def test_known_fingerprint_is_verified(module):
    fp = target_for(module).inspect(module).fingerprint
    target = dataclasses.replace(target_for(module), fingerprints={"1.0": fp})
    st, undo = target.patch(module, "1.0", config.load({}))
    assert st.state == "verified", st.reason
    undo.run()


def test_switch():
    assert shared_grad.TARGET.switch_variable == shared_grad.STANDALONE.switch_variable == "GEMM_PATCH_SHARED_GRAD"
    cfg = config.load({"GEMM_PATCH_SHARED_GRAD": "0"}, switches=("GEMM_PATCH_SHARED_GRAD",))
    st, undo = shared_grad.TARGET.patch(types.ModuleType("x"), "0.17.1", cfg)
    assert st.state == "off" and undo.steps == []


def test_same_code_in_both_distributions():
    core, standalone = shared_grad.TARGET.fingerprints, shared_grad.STANDALONE.fingerprints
    assert set(standalone.values()) <= set(core.values())
