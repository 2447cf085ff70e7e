"""A weight used twice in one backward under Megatron-FSDP's fine-grained parameter-gather hooks
(``enable_fine_grained_param_gather_hook``, and 0.19's ``..._backward_hook``), as upstream
training turns them on: every module unshards its own weights before its forward and before
its backward, and each unshard (``all_gather_and_wait_parameters_ready``) clears
``grad_added_to_main_grad``. Between the two uses of the tied embedding/output weight, or of
the output layer under multi-token prediction, the flag reads False: the second fused write
overwrote the first, or ``_grad_acc``'s copy of ``param.grad`` overwrote the fused wgrad.

The release's real hooks (``MegatronFSDP._register_fsdp_hooks``, patched), megatron's real
embedding and output layers, the sharded strategy ``optim_grads_params`` (its root
pre-backward hook too) with a fresh unzeroed bucket per backward, reduced and freed once per
backward, as on more than one data-parallel rank; the persistent buffer (one rank) alike.
Several micro-batches: each backward's first write must overwrite its new bucket. Every
parameter's gradient against fp64 autograd. The stand-ins are test_shared_weights.py's.
"""

from __future__ import annotations

import inspect

import pytest
from conftest import torch
from test_shared_weights import (  # noqa: F401  (fixtures: parallel, shared_on, cpu_dummy_wgrad)
    BUFFERS,
    CASES,
    LAYOUTS,
    MODULES,
    TESTED,
    TOL,
    cpu_dummy_wgrad,
    keeps_weight_arguments,
    parallel,
    rel,
    shared_on,
    train,
)

pytestmark = [pytest.mark.proves("fsdp-wgrad", "fsdp-shared-grad", "mfsdp-shared-grad"), LAYOUTS]

MICRO_BATCHES = 3


def has_fine_grained_hook(module) -> bool:
    return "enable_fine_grained_param_gather_hook" in inspect.signature(module.MegatronFSDP.__init__).parameters


HOOKED = [n for n in TESTED if has_fine_grained_hook(MODULES[n][1])]


@pytest.fixture(params=HOOKED)
def fsdp(request):
    """The MegatronFSDP copies (megatron-core's, the standalone megatron-fsdp's where importable)
    that have the fine-grained hooks; shared_on installs the target on each."""
    return MODULES[request.param]


def fine_grained_errors(module, target, *, tied, mtp, distributed):
    model, got, ref, obj = train(module, tied=tied, mtp=mtp, distributed=distributed,
                                 micro_batches=MICRO_BATCHES, strategy="optim_grads_params", fine_grained=True,
                                 upstream_failure_skips=not keeps_weight_arguments(target, module))
    # The per-module unshards ran in every backward (what clears the flag between two uses).
    assert obj.all_gather_pipeline.backward_gathers >= 2 * MICRO_BATCHES
    if distributed:
        # One fresh bucket per parameter and backward, each reduced once.
        for i, _ in enumerate(model.parameters()):
            assert obj.grad_reduce_pipeline.reduced.count(i) == MICRO_BATCHES, obj.grad_reduce_pipeline.reduced
    for name, grad in got.items():
        assert not torch.isnan(grad).any(), f"{name}: stale bucket memory reached the gradient"
    return {name: rel(got[name], ref[name]) for name in got}


@pytest.mark.skipif(not HOOKED, reason="no Megatron-FSDP with enable_fine_grained_param_gather_hook here")
@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("tied, mtp", CASES)
def test_every_parameter_matches_fp64_autograd(parallel, shared_on, tied, mtp, distributed):  # noqa: F811
    target, module = shared_on
    errors = fine_grained_errors(module, target, tied=tied, mtp=mtp, distributed=distributed)
    print(f"\nFINE_GRAINED {target.name} tied={tied} mtp={mtp} distributed={distributed} "
          + " ".join(f"{n}={e:.2e}" for n, e in errors.items()))
    assert all(e < TOL for e in errors.values()), errors


def test_the_hook_is_found_where_expected():
    """megatron-core 0.16+ (megatron-fsdp 0.3+) have the hook: the test above runs there."""
    for name, (_target, module) in MODULES.items():
        if name in TESTED and "fine_grained_param_gather" in inspect.getsource(module.MegatronFSDP):
            assert name in HOOKED, name
