"""fsdp-embedding-wgrad: megatron's ``VocabParallelEmbedding`` writes its lookup gradient straight
into a Megatron-FSDP weight's fp32 main_grad, under Megatron-FSDP's real hooks (the harness of
test_shared_weights.py: megatron's real layers and ``_register_fsdp_hooks``, fp64 oracle).

Proven here, per release: every parameter within bf16 rounding of fp64 autograd (tied, untied,
MTP, persistent and fresh buckets, one bucket per parameter or one for all); the lookup never
becomes a dense ``[vocab, hidden]`` gradient (autograd's ``embedding_dense_backward`` does not
run) and, where nothing else reaches the weight's gradient, nothing of that size is added to
main_grad, and nothing waits for a value on the host (no ``item``, ``nonzero``); a plain use of
the weight besides the lookup keeps its gradient; ``revert()`` takes
every hook the target put on a weight off it."""

from __future__ import annotations

import pytest
import test_shared_weights as harness
from conftest import torch
from test_shared_weights import (
    BUCKETS,
    BUFFERS,
    CASES,
    HIDDEN,
    PATCHED,
    TOL,
    VOCAB,
    TiedLM,
    expected_state,
    needs_code,
    rel,
    remove_hooks,
    train,
    wrap,
)

import gemm_patch
from gemm_patch.targets import embedding_wgrad
from gemm_patch.upstream import fsdp_rules

# The harness's fixtures: the release's MegatronFSDP (patched), megatron's model-parallel state.
fsdp, shared_on, parallel = harness.fsdp, harness.shared_on, harness.parallel

pytestmark = pytest.mark.proves("fsdp-embedding-wgrad", "fsdp-shared-grad", "mfsdp-shared-grad")

needs_lookup = pytest.mark.skipif(expected_state(embedding_wgrad.TARGET) not in PATCHED,
                                  reason="fsdp-embedding-wgrad does not know this release's embedding")


@pytest.fixture(autouse=True)
def cpu_dummy_wgrad(monkeypatch):
    # Without TE, megatron allocates the dummy wgrad it returns on torch.cuda.current_device().
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.fixture
def writes(monkeypatch):
    """Counts the lookups written into main_grad."""
    seen = []
    original = embedding_wgrad.write_rows

    def counting(param, ids, grad_output):
        seen.append(tuple(param.shape))
        return original(param, ids, grad_output)

    monkeypatch.setattr(embedding_wgrad, "write_rows", counting)
    return seen


def full_size_ops(prof) -> list[str]:
    """The operators the profiled backward ran on a tensor of the embedding's full shape: the
    dense lookup gradient, and additions or copies of [vocab, hidden] tensors."""
    out = []
    for e in prof.events():
        if e.name == "aten::embedding_dense_backward":
            out.append(e.name)
        elif e.name in ("aten::add_", "aten::add", "aten::copy_", "aten::clone") and \
                any(list(s) == [VOCAB, HIDDEN] for s in e.input_shapes):
            out.append(e.name)
    return out


@needs_code
@needs_lookup
@pytest.mark.parametrize("buckets", BUCKETS)
@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("tied, mtp", CASES)
def test_every_parameter_matches_fp64_with_the_lookup_written_into_main_grad(parallel, shared_on, writes, tied, mtp,
                                                                             distributed, buckets, monkeypatch):
    target, module = shared_on
    status = {s.name: s.state for s in gemm_patch.status().targets}
    assert status["fsdp-embedding-wgrad"] in PATCHED, status
    oracle, inputs = harness.reference, []
    monkeypatch.setattr(harness, "reference", lambda *args: inputs.append(args) or {})  # outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        model, got, _, obj = train(module, tied=tied, mtp=mtp, distributed=distributed, buckets=buckets,
                                   upstream_failure_skips=False)
    ref = oracle(*inputs[0])
    if not fsdp_rules.takes_direct_writes(model.embedding.weight):
        # 0.14-0.15: a post-backward hook after every module call; the lookup is left to autograd
        assert not writes
        return
    uses = 2 if mtp else 1
    assert writes == [(VOCAB, HIDDEN)] * (2 * uses), writes  # two micro-batches
    for name in got:
        assert not torch.isnan(got[name]).any(), name
        assert rel(got[name], ref[name]) < TOL, (name, rel(got[name], ref[name]))
    ops = full_size_ops(prof)
    assert "aten::embedding_dense_backward" not in ops, "autograd made the dense lookup gradient"
    syncs = [e.name for e in prof.events() if e.name in ("aten::item", "aten::_local_scalar_dense", "aten::nonzero")]
    assert not syncs, f"a host sync in the step: {syncs}"
    if not mtp:
        # The one zero dummy alone reached the weight's gradient: nothing of full size added.
        assert not [op for op in ops if op in ("aten::add_", "aten::add")], ops


@needs_code
@needs_lookup
@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_plain_use_of_the_weight_keeps_its_gradient(parallel, shared_on, writes, tied, distributed):
    """The weight also used outside the lookup and the output layer (here ``(weight * M).sum()``,
    gradient M): that gradient reaches main_grad beside the lookup's, as without the target."""
    _, module = shared_on
    torch.manual_seed(3)
    model = TiedLM(tied=tied)
    obj = wrap(module, model, distributed)
    gen = torch.Generator().manual_seed(4)
    weight = model.embedding.weight
    extra = torch.randn(weight.shape, generator=gen).to(weight.dtype)
    reference = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    try:
        for _ in range(2):
            tokens = torch.randint(0, VOCAB, (2, 6), generator=gen)
            logits = obj.module(tokens)[0]
            g = torch.randn(logits.shape, generator=gen).to(logits.dtype)
            torch.autograd.backward([logits, (weight * extra).sum()], [g, None])
            emb = reference["embedding.weight"]
            out = emb if tied else reference["output_layer.weight"]
            ((emb[tokens] @ out.t()) * g.double()).sum().add((emb * extra.double()).sum()).backward()
    finally:
        remove_hooks(obj)
    if not fsdp_rules.takes_direct_writes(weight):
        pytest.skip("the lookup is left to autograd on this release's hooks")
    assert writes
    got = weight._gbuf.item(weight._gbuf.data, weight).double()
    assert rel(got, reference["embedding.weight"].grad) < TOL, rel(got, reference["embedding.weight"].grad)


@needs_code
@needs_lookup
def test_revert_takes_every_hook_off_the_weight(parallel, shared_on):
    _, module = shared_on
    torch.manual_seed(5)
    model = TiedLM(tied=True)
    obj = wrap(module, model, False)
    weight = model.embedding.weight

    def own():
        return [h for h in (weight._backward_hooks or {}).values() if getattr(h, "_gemm_patch_own", False)]

    try:
        tokens = torch.randint(0, VOCAB, (2, 6))
        logits = obj.module(tokens)[0]
        logits.backward(torch.ones_like(logits))
        if not fsdp_rules.takes_direct_writes(weight):
            pytest.skip("the lookup is left to autograd on this release's hooks")
        assert len(own()) == 1
        gemm_patch.revert()
        assert not own()
    finally:
        gemm_patch.apply()
        remove_hooks(obj)
