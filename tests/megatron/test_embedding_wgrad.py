"""fsdp-embedding-wgrad: megatron's ``VocabParallelEmbedding`` writes its lookup gradient straight
into a Megatron-FSDP weight's fp32 main_grad, under Megatron-FSDP's real hooks (the harness of
test_shared_weights.py: megatron's real layers and ``_register_fsdp_hooks``, fp64 oracle).

Proven here, per release: every parameter within bf16 rounding of fp64 autograd (tied, untied,
MTP, persistent and fresh buckets, one bucket per parameter or one for all); the lookup never
becomes a dense ``[vocab, hidden]`` gradient (autograd's ``embedding_dense_backward`` does not
run) and, where nothing else reaches the weight's gradient, nothing of that size is added to
main_grad, and nothing waits for a value on the host (no ``item``, ``nonzero``); a plain use of
the weight besides the lookup keeps its gradient; ``revert()`` takes
every hook the target put on a weight off it. With fusion off the lookup is megatron's own, bit
for bit. However the backward is asked for (``torch.autograd.grad`` capturing the weight, a second
backward through a retained graph) and whatever changes between a forward and its backward
(``revert()``, a switch at ``apply()``), what autograd returns and what main_grad holds are
upstream's, against fp64."""

from __future__ import annotations

import gc

import pytest
import test_shared_weights as harness
from conftest import applied_without, torch
from test_shared_weights import (
    BUCKETS,
    BUFFERS,
    CASES,
    HIDDEN,
    LAYOUTS,
    PATCHED,
    TOL,
    VOCAB,
    TiedLM,
    expected_state,
    needs_code,
    rel,
    remove_hooks,
    run,
    train,
    wrap,
)

import gemm_patch
from gemm_patch.targets import embedding_wgrad
from gemm_patch.upstream import fsdp_rules

# The harness's fixtures: the release's MegatronFSDP (patched), megatron's model-parallel state.
fsdp, shared_on, parallel = harness.fsdp, harness.shared_on, harness.parallel

pytestmark = [pytest.mark.proves("fsdp-embedding-wgrad", "fsdp-shared-grad", "mfsdp-shared-grad"), LAYOUTS]

needs_lookup = pytest.mark.skipif(expected_state(embedding_wgrad.TARGET) not in PATCHED,
                                  reason="fsdp-embedding-wgrad does not know this release's embedding")


@pytest.fixture(autouse=True)
def collected():
    """Each test's instances collected after it (their hooks removed, they are garbage in a
    cycle): a later apply() must not find them and report them as built before it."""
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def cpu_dummy_wgrad(monkeypatch):
    # Without TE, megatron allocates the dummy wgrad it returns on torch.cuda.current_device().
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.fixture
def writes(monkeypatch):
    """Counts the lookups written into main_grad."""
    seen = []
    original = embedding_wgrad.write_rows

    def counting(param, *args):
        result = original(param, *args)
        if result is None or result.stride() == (0, 0):  # not upstream's dense gradient: written
            seen.append(tuple(param.shape))
        return result

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
        # The one zero dummy alone reached the weight's gradient: nothing of full size added, and
        # autograd stored the view of main_grad it was handed instead of a dense copy of zeros.
        assert not [op for op in ops if op in ("aten::add_", "aten::add")], ops
        assert fsdp_rules.ONLY_ZEROS.get(model.embedding.weight) is not None, "the zero dummy was copied"


@pytest.fixture
def defective_writer(monkeypatch):
    """A writer whose rows come out 1.03 times too large: a defect a run it takes part in shows."""
    original = embedding_wgrad.write_rows

    def defective(param, ids, grad_output, *args):
        return original(param, ids, grad_output * 1.03, *args)

    monkeypatch.setattr(embedding_wgrad, "write_rows", defective)


@needs_code
@needs_lookup
@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("tied, mtp", CASES)
def test_fusion_off_runs_megatrons_own_lookup(parallel, shared_on, defective_writer, writes, tied, mtp, distributed):
    """With megatron's gradient_accumulation_fusion off for the model, the lookup is megatron's
    own (autograd's dense gradient, added by Megatron-FSDP's hook): the same bits as with the
    target off, whatever the writer does. A fusion-off run (gemm-patch compare's reference, or a
    user ruling gemm-patch out) never runs the writer."""
    _, module = shared_on
    model, got, ref, _ = train(module, tied=tied, mtp=mtp, distributed=distributed, fusion=False)
    assert not writes, writes
    within(got, ref)
    with applied_without("fsdp-embedding-wgrad"):
        _, off, _, _ = train(module, tied=tied, mtp=mtp, distributed=distributed, fusion=False)
    assert all(torch.equal(got[n], off[n]) for n in got), {n: rel(got[n], off[n]) for n in got}
    # The same defect shows where fusion is on: the writer does run there.
    model, got, ref, _ = train(module, tied=tied, mtp=mtp, distributed=distributed)
    if fsdp_rules.takes_direct_writes(model.embedding.weight):
        assert writes and rel(got["embedding.weight"], ref["embedding.weight"]) > TOL


@needs_code
@needs_lookup
@pytest.mark.parametrize("distributed", BUFFERS)
def test_where_fusion_cannot_be_read_the_writer_steps_aside(parallel, shared_on, writes, distributed):
    """Neither the embedding (megatron-core before 0.18 keeps no configuration there) nor the
    model wrapped by the MegatronFSDP holds a configuration: megatron's own lookup runs."""
    _, module = shared_on
    torch.manual_seed(0)
    model = TiedLM(tied=True)
    del model.config
    vars(model.embedding).pop("config", None)
    obj = wrap(module, model, distributed)
    _, got, ref, _ = run(model, obj)
    assert not writes, writes
    within(got, ref)


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
    """The writer's pre-hook on the weight's gradient accumulator (autograd's AccumulateGrad
    node, alive while a graph or anything holds it) is there after a backward and gone after
    ``revert()``; the weight itself never gets a hook."""
    _, module = shared_on
    torch.manual_seed(5)
    model = TiedLM(tied=True)
    obj = wrap(module, model, False)
    weight = model.embedding.weight
    node = fsdp_rules.accumulator(weight)  # held: the node the graphs below lead to

    def own():
        handle = node.metadata.get(fsdp_rules.PREHOOK_KEY)
        hooks = handle.hooks_dict_ref() if handle is not None else None
        return [] if hooks is None else [h for key, h in hooks.items() if key == handle.id]

    try:
        tokens = torch.randint(0, VOCAB, (2, 6))
        logits = obj.module(tokens)[0]
        logits.backward(torch.ones_like(logits))
        if not fsdp_rules.takes_direct_writes(weight):
            pytest.skip("the lookup is left to autograd on this release's hooks")
        assert len(own()) == 1 and not weight._backward_hooks
        gemm_patch.revert()
        assert not own()
    finally:
        gemm_patch.apply()
        remove_hooks(obj)


# -- how the backward is asked for, and what changes between a forward and its backward ----------

TIED = [pytest.param(True, id="tied"), pytest.param(False, id="untied")]


def batches(n: int, seed: int = 1) -> list:
    """``n`` micro-batches: (tokens, the logits' output gradient)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (2, 6), generator=gen),
             torch.randn(2, 6, VOCAB, generator=gen).to(torch.bfloat16)) for _ in range(n)]


def fp64(model, micro_batches, extra=None, times: int = 1, plain: tuple | None = None) -> dict:
    """Every parameter's fp64 gradient of the micro-batches' losses (``sum(logits * g)``, plus
    ``sum(weight * extra)`` where given, in the micro-batches ``plain`` lists: all of them by
    default), each backward ``times`` times."""
    params = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    emb = params["embedding.weight"]
    out = emb if model.tied else params["output_layer.weight"]
    for i, (tokens, g) in enumerate(micro_batches):
        loss = ((emb[tokens] @ out.t()) * g.double()).sum()
        if extra is not None and (plain is None or i in plain):
            loss = loss + (emb * extra.double()).sum()
        (loss * times).backward()
    return {n: p.grad for n, p in params.items()}


def built(module, distributed: bool, **model_kwargs) -> tuple:
    """A ``TiedLM(**model_kwargs)`` and the release's MegatronFSDP over it."""
    torch.manual_seed(0)
    model = TiedLM(**model_kwargs)
    return model, wrap(module, model, distributed)


def reduced(model) -> dict:
    """Each parameter's gradient as Megatron-FSDP holds it after the step (its persistent shard)."""
    for n, p in model.named_parameters():
        assert p._gbuf.bucket is None, f"{n}: bucket never reduced"
    return {n: p._gbuf.item(p._gbuf.data, p).double() for n, p in model.named_parameters()}


def lm_backward(obj, model, tokens, g, extra=None) -> None:
    """Forward through the MegatronFSDP's root and backward of ``sum(logits * g)`` (plus the
    weight's plain use ``sum(weight * extra)``)."""
    logits = obj.module(tokens)[0]
    outputs, grads = [logits], [g]
    if extra is not None:
        outputs.append((model.embedding.weight * extra).sum())
        grads.append(None)
    torch.autograd.backward(outputs, grads)


def within(got: dict, ref: dict, tol: float = TOL) -> dict:
    errors = {n: rel(got[n], ref[n]) for n in ref}
    assert all(e < tol for e in errors.values()), errors
    return errors


@needs_code
@needs_lookup
@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("tied", TIED)
def test_autograd_grad_of_the_weight_gets_the_lookups_gradient_and_leaves_main_grad(parallel, shared_on, writes,
                                                                                     tied, distributed):
    """``torch.autograd.grad`` with the embedding weight among its inputs (a gradient penalty)
    captures the weight's gradient instead of accumulating it: autograd returns upstream's dense
    lookup gradient, and main_grad is left to the backwards that accumulate."""
    _, module = shared_on
    model, obj = built(module, distributed, tied=tied)
    weight = model.embedding.weight
    steps = batches(2)
    try:
        for tokens, g in steps:
            looked_up = obj.module.embedding(tokens)
            (got,) = torch.autograd.grad(looked_up.float().pow(2).sum(), [weight])
            emb = weight.detach().double().requires_grad_()
            emb[tokens].pow(2).sum().backward()
            assert got.dtype == weight.dtype and rel(got.double(), emb.grad) < TOL, rel(got.double(), emb.grad)
            lm_backward(obj, model, tokens, g)
    finally:
        remove_hooks(obj)
    within(reduced(model), fp64(model, steps))
    if fsdp_rules.takes_direct_writes(weight):
        assert writes == [(VOCAB, HIDDEN)] * 2, writes  # the accumulating backwards wrote; the captures did not


@needs_code
@needs_lookup
@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("tied", TIED)
def test_a_second_backward_through_a_retained_graph_adds_as_upstream(parallel, shared_on, writes, tied, distributed):
    _, module = shared_on
    model, obj = built(module, distributed, tied=tied)
    steps = batches(2)
    try:
        for tokens, g in steps:
            logits = obj.module(tokens)[0]
            torch.autograd.backward([logits], [g], retain_graph=True)
            torch.autograd.backward([logits], [g])
    finally:
        remove_hooks(obj)
    within(reduced(model), fp64(model, steps, times=2))
    if fsdp_rules.takes_direct_writes(model.embedding.weight):
        assert writes == [(VOCAB, HIDDEN)] * 4, writes


CHANGES = ("revert", "shared_grad_off", "lookup_off", "reapply")


def change(how: str, monkeypatch) -> None:
    """What happens while micro-batch 2 waits for (or runs) its backward: ``revert()``;
    fsdp-shared-grad or fsdp-embedding-wgrad switched off at an ``apply()``; ``apply()`` after a
    ``revert()`` made before the forward (``reapply``)."""
    if how == "revert":
        gemm_patch.revert()
    elif how == "reapply":
        gemm_patch.apply()
    else:
        monkeypatch.setenv({"shared_grad_off": "GEMM_PATCH_SHARED_GRAD",
                            "lookup_off": "GEMM_PATCH_EMBEDDING_WGRAD"}[how], "0")
        gemm_patch.apply()


def train_with_change(module, *, tied, distributed, fusion, how, in_backward, monkeypatch, extra) -> tuple:
    """Two micro-batches; the change made between micro-batch 2's forward and its backward, or
    (``in_backward``) inside that backward, after the output layer's and before the lookup's
    (a hook on the looked-up activations). The patch is as the test found it afterwards."""
    model, obj = built(module, distributed, tied=tied, fusion=fusion)
    if not fsdp_rules.takes_direct_writes(model.embedding.weight):
        remove_hooks(obj)
        pytest.skip("the lookup is left to autograd on this release's hooks")
    (t1, g1), (t2, g2) = steps = batches(2)
    try:
        with monkeypatch.context() as m:
            lm_backward(obj, model, t1, g1, extra)
            if how == "reapply":
                gemm_patch.revert()
            hook = model.embedding.register_forward_hook(
                lambda _, __, out: out.register_hook(lambda grad: change(how, m)) and None) if in_backward else None
            logits = obj.module(t2)[0]
            if hook is not None:
                hook.remove()
            else:
                change(how, m)
            torch.autograd.backward([logits, (model.embedding.weight * extra).sum()], [g2, None])
    finally:
        gemm_patch.revert()
        gemm_patch.apply()
        remove_hooks(obj)
    return model, reduced(model), steps


def placements() -> list:
    """(fusion, change, in its backward?). ``revert()`` before a fused backward: megatron's own
    fused write into an fp32 main_grad fails on the CPU (what fsdp-wgrad fixes), and ``apply()``
    inside a backward brings no hooks under the patch (test_built_before_apply): left out."""
    out = []
    for fusion in (True, False):
        for how in CHANGES:
            for in_backward in (False, True):
                if (how == "revert" and fusion and not in_backward) or (how == "reapply" and in_backward):
                    continue
                out.append(pytest.param(fusion, how, in_backward, id=f"{'fusion' if fusion else 'no_fusion'}-{how}-"
                                        f"{'in_backward' if in_backward else 'before_backward'}"))
    return out


@needs_code
@needs_lookup
@pytest.mark.parametrize("fusion, how, in_backward", placements())
@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("tied", TIED)
def test_a_change_between_a_forward_and_its_backward_loses_nothing(parallel, shared_on, tied, distributed, fusion, how,
                                                                  in_backward, monkeypatch):
    """A pipeline schedule keeps forwards waiting for their backwards. The backward of a lookup
    recorded under the writer writes into main_grad only where the gradient then goes through
    the twin's hooks, or where megatron's own hooks (``revert()``, fsdp-shared-grad off) will
    drop ``param.grad`` because a fused write of this backward is in main_grad already (the tied
    weight under fusion: the lookup is kept there); elsewhere megatron's dense gradient. So every
    parameter matches fp64, but for what megatron's own hooks drop of a tied weight under fusion:
    its other uses' gradients of that backward (here a plain use of the weight, besides the
    output layer). Without fusion the writer never runs (megatron's own path, right)."""
    _, module = shared_on
    extra = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    model, got, steps = train_with_change(module, tied=tied, distributed=distributed, fusion=fusion, how=how,
                                          in_backward=in_backward, monkeypatch=monkeypatch, extra=extra)
    megatrons_hooks = how in ("revert", "shared_grad_off")
    dropped = fusion and tied and megatrons_hooks
    within(got, fp64(model, steps, extra, plain=(0,) if dropped else None))
