"""The dummy ``grad_weight`` megatron returns after a fused write, under Megatron-FSDP.

megatron's backward returns a full-size tensor so that autograd runs the gradient hooks; with TE
it is TE's per-shape cache (1 GiB of bf16 for a 128256 x 4096 output layer, held for the whole
process), without TE a fresh ``torch.empty``. fsdp-wgrad's optional part returns a view of the
first bytes of the weight's own ``main_grad`` instead. These tests run megatron's own backward
with a post-accumulate-grad hook that does what Megatron-FSDP's ``_grad_acc`` does with a fused
weight (delete ``param.grad`` when ``grad_added_to_main_grad`` is set) and check where the dummy
lives, that the gradient is still exact, and every case where the view must not be given.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import APPLICABLE, asked_in_backward, layers, torch
from test_fsdp_accumulate import backward_micro_batches, megatron_fsdp_param, rel
from test_safety import run

import gemm_patch

pytestmark = [pytest.mark.skipif(not APPLICABLE, reason="release has no such call site"),
              pytest.mark.proves("fsdp-wgrad")]


def storage_of(tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def run_with_fsdp_hook(weight, n: int, seed: int = 1, tokens: int = 48, micro_batches=backward_micro_batches):
    """n micro-batches through megatron's fused-wgrad function; returns each micro-batch's exact
    gradient and the storage each dummy ``.grad`` lived in when the hook saw it."""
    seen: list[int] = []

    def grad_acc(param):  # Megatron-FSDP's _grad_acc, for a weight the fused path wrote
        seen.append(storage_of(param.grad))
        if param.grad_added_to_main_grad and param.grad is not None:
            del param.grad
        param.grad_added_to_main_grad = False

    # Megatron-FSDP's own hook deletes the dummy unread; the view's rule tells it from a user's
    # hook by the module that defines it (fsdp_rules.has_tensor_hooks).
    grad_acc.__module__ = "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp"
    handle = weight.register_post_accumulate_grad_hook(grad_acc)
    exact = []
    try:
        for grad in micro_batches(weight, n, tokens, seed):
            exact.append(grad)
            assert weight.grad is None, "the hook did not drop the dummy"
    finally:
        handle.remove()
    return exact, seen


@pytest.fixture
def cpu_dummy(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.mark.parametrize("distributed", [False, True], ids=["persistent", "fresh-bucket"])
def test_the_dummy_is_a_view_of_main_grad_and_the_gradient_stays_exact(patched, cpu_dummy, distributed):
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=distributed)
    exact, seen = run_with_fsdp_hook(weight, 3)
    mains = [gbuf.data] * 3 if not distributed else gbuf.buckets
    assert seen == [storage_of(m) for m in mains], "the dummy was allocated, not a view of main_grad"
    if distributed:
        for bucket, ref in zip(gbuf.buckets, exact, strict=True):
            assert rel(bucket.view(weight.shape), ref) < 1e-6
    else:
        assert rel(gbuf.data.view(weight.shape), sum(exact)) < 1e-6


def test_bf16_main_grad_is_aliased_too(patched, cpu_dummy):
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=False, main_dtype=torch.bfloat16)
    exact, seen = run_with_fsdp_hook(weight, 2)
    assert seen == [storage_of(gbuf.data)] * 2
    assert rel(gbuf.data.view(weight.shape), sum(exact)) < 2 ** -7


@pytest.mark.parametrize("mark", ["_is_shared", "shared", "shared_embedding"])
def test_a_weight_marked_as_used_twice_gets_megatrons_dummy(patched, cpu_dummy, mark):
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=False)
    setattr(weight, mark, True)
    exact, seen = run_with_fsdp_hook(weight, 2)
    assert storage_of(gbuf.data) not in seen
    assert rel(gbuf.data.view(weight.shape), sum(exact)) < 1e-6


def alias_in_backward(param, shape, dtype):
    from gemm_patch.upstream.fsdp_rules import main_grad_alias

    return asked_in_backward(param, lambda: main_grad_alias(param, shape, dtype))


def test_a_pending_grad_is_never_aliased(patched, cpu_dummy):
    """A ``.grad`` left from an earlier use would be added to in place by autograd: that add
    must not land in main_grad."""
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=False)
    weight.grad = torch.zeros_like(weight)
    weight.main_grad = gbuf.data.view(weight.shape)
    assert alias_in_backward(weight, list(weight.shape), torch.bfloat16) is None
    weight.grad = None
    assert alias_in_backward(weight, list(weight.shape), torch.bfloat16) is not None
    assert alias_in_backward(weight, [41, 32], torch.float32) is None  # more bytes than main_grad
    plain = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))
    plain.main_grad = torch.zeros(4, 4)
    assert alias_in_backward(plain, [4, 4], torch.bfloat16) is None  # not Megatron-FSDP's


def fused_forward(weight, seed: int, tokens: int = 48):
    """One forward through megatron's fused-wgrad function: its input, output, a gradient for
    the output, and the weight gradient that gradient makes (fp64)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, weight.shape[1], generator=gen).to(torch.bfloat16).requires_grad_()
    y = layers.linear_with_grad_accumulation_and_async_allreduce(
        x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False)
    grad_out = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
    return x, y, grad_out, grad_out.double().t() @ x.detach().double()


def fused_handed_back(weight, how: str, seed: int = 3, tokens: int = 48):
    """One micro-batch through megatron's fused-wgrad function whose backward hands the weight's
    gradient back instead of accumulating it: ``torch.autograd.grad`` with the weight among its
    inputs (a gradient penalty, a per-layer gradient tool), or ``backward(inputs=...)`` without
    it. Returns what autograd handed back for the weight (None for ``inputs=``) and the
    micro-batch's exact gradient."""
    x, y, grad_out, exact = fused_forward(weight, seed, tokens)
    returned = None
    if how == "autograd.grad":
        (returned,) = torch.autograd.grad(y, [weight], grad_out)
    else:
        y.backward(grad_out, inputs=[x])
    return returned, exact


@pytest.mark.parametrize("zero_out", [False, True], ids=["view", "zeros"])
@pytest.mark.parametrize("distributed", [False, True], ids=["persistent", "fresh-bucket"])
def test_autograd_grad_of_the_weight_hands_back_megatrons_dummy(patched, cpu_dummy, distributed, zero_out):
    """``torch.autograd.grad`` hands the weight's gradient to its caller: upstream hands megatron's
    dummy (uninitialised, or zeros), which the caller may scale or clip in place. The view of
    main_grad, or the broadcast zeros, must not be what it gets: a write into the one lands in
    main_grad, into the other it raises. main_grad still gets the fused write, as upstream."""
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=distributed)
    if zero_out:
        weight.zero_out_wgrad = True
    returned, exact = fused_handed_back(weight, "autograd.grad")
    main = (gbuf.buckets[-1] if distributed else gbuf.data).view(weight.shape)
    assert storage_of(returned) != storage_of(main), "autograd.grad handed back a view of main_grad"
    assert returned.stride() == weight.stride(), f"not a dense tensor: strides {returned.stride()}"
    written = main.clone()
    returned.mul_(0.5)  # the caller's in-place use of what it was given
    assert torch.equal(main, written), "a write into the returned gradient changed main_grad"
    assert rel(main, exact) < 1e-6
    if zero_out:
        assert not returned.any(), "megatron's zeros dummy is zeros"
    # The next micro-batch's ordinary backward gets the view again.
    _, seen = run_with_fsdp_hook(weight, 1)
    assert zero_out or seen == [storage_of(gbuf.buckets[-1] if distributed else gbuf.data)]


@pytest.mark.parametrize("how", ["autograd.grad", "inputs="])
@pytest.mark.parametrize("distributed", [False, True], ids=["persistent", "fresh-bucket"])
def test_the_next_backward_after_a_handed_back_gradient_writes_its_own(patched, cpu_dummy, distributed, how):
    """A backward that hands the weight's gradient back runs no ``_grad_acc``, so megatron's
    ``grad_added_to_main_grad`` stays set after its fused write. The next micro-batch's fresh
    bucket (unzeroed) must still be written over, not added to as if this backward had written
    it already (NaN: the bucket's earlier bytes); the persistent buffer adds both, as it adds
    every fused write of the step."""
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=distributed)
    _, handed_back = fused_handed_back(weight, how)
    assert weight.grad_added_to_main_grad and weight.grad is None
    exact, _ = run_with_fsdp_hook(weight, 2)
    if distributed:
        for bucket, ref in zip(gbuf.buckets[1:], exact, strict=True):
            assert rel(bucket.view(weight.shape), ref) < 1e-6
    else:
        assert rel(gbuf.data.view(weight.shape), handed_back + sum(exact)) < 1e-6


@pytest.mark.parametrize("distributed", [False, True], ids=["persistent", "fresh-bucket"])
def test_a_backward_through_the_graph_autograd_grad_kept_writes_its_own(patched, cpu_dummy, distributed):
    """The gradient-penalty pattern: ``torch.autograd.grad(..., retain_graph=True)``, then
    ``backward()`` through the same graph, no forward (and so no unshard) in between. The
    backward's fresh bucket gets its own gradient, written over; the persistent buffer both."""
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=distributed)
    _, y, grad_out, exact = fused_forward(weight, seed=9)
    torch.autograd.grad(y, [weight], grad_out, retain_graph=True)
    y.backward(grad_out)
    if distributed:
        assert len(gbuf.buckets) == 2 and rel(gbuf.buckets[1].view(weight.shape), exact) < 1e-6
    else:
        assert rel(gbuf.data.view(weight.shape), 2 * exact) < 1e-6


def test_activation_recompute_keeps_the_view(patched, cpu_dummy):
    """Under reentrant activation recompute (megatron's own ``CheckpointFunction`` is reentrant)
    the fused backward runs in a backward nested in the step's: it accumulates into ``.grad``,
    so the view is given there too, and the gradient is exact."""
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=False)

    def recomputed(weight, n, tokens, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(n):
            x = torch.randn(tokens, weight.shape[1], generator=gen).to(torch.bfloat16).requires_grad_()
            y = torch.utils.checkpoint.checkpoint(
                lambda x: layers.linear_with_grad_accumulation_and_async_allreduce(
                    x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False,
                    sequence_parallel=False), x, use_reentrant=True)
            grad_out = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
            y.backward(grad_out)
            yield grad_out.double().t() @ x.detach().double()

    exact, seen = run_with_fsdp_hook(weight, 2, micro_batches=recomputed)
    assert seen == [storage_of(gbuf.data)] * 2, "recompute got megatron's dummy, not the view"
    assert rel(gbuf.data.view(weight.shape), sum(exact)) < 1e-6


@pytest.mark.parametrize("distributed", [False, True], ids=["persistent", "fresh-bucket"])
def test_a_second_backward_through_a_retained_graph_writes_again(patched, cpu_dummy, distributed):
    """``backward(retain_graph=True)`` then ``backward()``: each runs megatron's backward again and
    writes the micro-batch's gradient once more: added into the persistent buffer, each into
    its own fresh bucket; the input's gradient adds up as autograd's does."""
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=distributed)
    x, y, grad_out, exact = fused_forward(weight, seed=5)
    y.backward(grad_out, retain_graph=True)
    weight.grad, weight.grad_added_to_main_grad = None, False  # _grad_acc
    y.backward(grad_out)
    if distributed:
        assert len(gbuf.buckets) == 2 and all(rel(b.view(weight.shape), exact) < 1e-6 for b in gbuf.buckets)
    else:
        assert rel(gbuf.data.view(weight.shape), 2 * exact) < 1e-6
    assert rel(x.grad.double(), 2 * (grad_out.double() @ weight.detach().double())) < 1e-2


def test_cuda_graph_capture_gets_megatrons_dummy(patched, cpu_dummy, monkeypatch):
    """During capture the dummy keeps megatron's (TE's cached, fixed-address) tensor."""
    from gemm_patch.upstream import fsdp_rules

    monkeypatch.setattr(fsdp_rules, "view_forbidden", lambda tensor: True)
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=False)
    exact, seen = run_with_fsdp_hook(weight, 2)
    assert storage_of(gbuf.data) not in seen
    assert rel(gbuf.data.view(weight.shape), sum(exact)) < 1e-6


def test_anomaly_mode_gets_megatrons_dummy():
    """Anomaly mode checks every returned gradient for NaN; main_grad's bits read as bf16 may
    be NaN, so the view is not given there. (Megatron's own dummy is uninitialised memory, so
    its backward can fail that check too: only the choice is tested.)"""
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=False)
    weight.main_grad = gbuf.data.view(weight.shape)
    assert alias_in_backward(weight, list(weight.shape), torch.bfloat16) is not None
    with torch.autograd.detect_anomaly(check_nan=True):
        assert alias_in_backward(weight, list(weight.shape), torch.bfloat16) is None


def test_status_says_what_the_dummy_is(patched):
    fsdp = {t.name: t for t in gemm_patch.status().targets}["fsdp-wgrad"]
    assert fsdp.reason.endswith("dummy grad_weight: a view of main_grad"), fsdp.reason


def test_switched_off_megatron_allocates_its_own_dummy(cpu_dummy):
    """GEMM_PATCH_FSDP_DUMMY_GRAD=0, in a fresh interpreter: the fix to the call stays, the
    dummy is megatron's (a storage of its own), the status says so."""
    snippet = f"""
import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}]
import torch; torch.cuda.current_device = lambda: "cpu"
import gemm_patch; gemm_patch.apply()
from test_fsdp_dummy_grad import run_with_fsdp_hook, storage_of
from test_fsdp_accumulate import backward_micro_batches, megatron_fsdp_param, rel
from test_safety import run
weight, gbuf = megatron_fsdp_param(40, 32, distributed=False)
exact, seen = run_with_fsdp_hook(weight, 2)
assert storage_of(gbuf.data) not in seen, seen
assert rel(gbuf.data.view(weight.shape), sum(exact)) < 1e-6
reason = {{t.name: t for t in gemm_patch.status().targets}}["fsdp-wgrad"].reason
print(reason)
"""
    out = run(snippet, GEMM_PATCH_FSDP_DUMMY_GRAD="0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "megatron's (GEMM_PATCH_FSDP_DUMMY_GRAD=0)" in out.stdout


def halve_grad(param):
    param.grad.mul_(0.5)


@pytest.mark.parametrize("zero_out", [False, True], ids=["view", "zeros"])
@pytest.mark.parametrize("hook", ["tensor", "post_accumulate"])
def test_a_weight_with_a_tensor_hook_gets_megatrons_dummy(patched, cpu_dummy, zero_out, hook):
    """0.4.0 handed a hook that scales in place (``g.mul_(0.5)``, or ``p.grad.mul_(0.5)`` in a
    post-accumulate-grad hook that runs before Megatron-FSDP's) the view of main_grad, which it
    halved, or the broadcast zeros, where ``mul_`` raises: the hook must get megatron's own dummy,
    as upstream, and main_grad keep the exact gradient."""
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=False)
    if zero_out:
        weight.zero_out_wgrad = True  # the tied weight on a stage without the embedding's use
    handle = (weight.register_hook(lambda g: g.mul_(0.5)) if hook == "tensor"
              else weight.register_post_accumulate_grad_hook(halve_grad))
    exact, seen = run_with_fsdp_hook(weight, 2)
    assert storage_of(gbuf.data) not in seen
    assert rel(gbuf.data.view(weight.shape), sum(exact)) < 1e-6
    handle.remove()  # no hook left: the view again
    _, seen = run_with_fsdp_hook(weight, 1)
    assert zero_out or seen == [storage_of(gbuf.data)]


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_the_accumulator_is_found_where_the_running_node_does_not_take_the_weight(how):
    """``accumulates_into_grad`` asked from a node whose inputs do not include the weight (the
    weight used elsewhere in the graph): it reaches the weight's accumulator another way and
    answers as for a direct input."""
    from gemm_patch.upstream.fsdp_rules import accumulates_into_grad, hands_gradient_back

    weight = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(4, 4, requires_grad=True)
    answers = []

    class Elsewhere(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            answers.append((accumulates_into_grad(weight), hands_gradient_back(weight)))
            return grad * 2

    loss = Elsewhere.apply(x).sum() + (weight * x).sum()
    if how == "backward":
        loss.backward()
        assert answers == [(True, False)]
    else:
        torch.autograd.grad(loss, [x, weight])
        assert answers == [(False, True)]
