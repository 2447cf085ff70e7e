# ruff: noqa: F811  (pytest fixtures imported from test_shared_weights are the test functions' parameters)
"""The zeros dummy ``grad_weight`` of the tied embedding/output weight, under Megatron-FSDP.

``LanguageModule`` marks the tied weight ``zero_out_wgrad``; after the output layer's fused write,
megatron's backward returns zeros of the weight's shape, so that the embedding lookup's gradient
can be added on top. With TE that is ``get_dummy_wgrad(shape, dtype, zero=True)``: one tensor per
shape kept for the whole process (on the H200, 128256 x 4096 bf16: the 1002 MB that a tied
``pretrain_gpt.py`` held above fusion off, between steps and at the peak). fsdp-wgrad's dummy
option returns one zero broadcast to the shape instead.

What is real: megatron's embedding and output layers and fused backward, the release's
``MegatronFSDP._register_fsdp_hooks`` (patched by fsdp-shared-grad), and TE's own
``get_dummy_wgrad`` compiled from TE 2.20.2's ``base.py`` (tests/te_files.py), put into megatron's
layers module as its ``from transformer_engine... import get_dummy_wgrad`` does where TE is
installed. The stand-ins for Megatron-FSDP's buffers are test_shared_weights.py's.
"""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

import pytest
import test_shared_weights as tied_lm
from conftest import APPLICABLE, asked_in_backward, torch
from test_shared_weights import (  # noqa: F401  (fixtures: fsdp, parallel, shared_on, cpu_dummy_wgrad)
    CASES,
    TOL,
    cpu_dummy_wgrad,
    fsdp,
    keeps_weight_arguments,
    needs_code,
    parallel,
    rel,
    shared_on,
    train,
)

from gemm_patch.targets import fsdp_wgrad

pytestmark = [pytest.mark.proves("fsdp-wgrad", "fsdp-shared-grad", "mfsdp-shared-grad"), tied_lm.LAYOUTS,
              pytest.mark.skipif(not APPLICABLE, reason="release has no such call site"), needs_code]

TE_VERSION = "2.20.2"
BUFFERS = [pytest.param(False, id="persistent"), pytest.param(True, id="fresh")]
SHAPE = (tied_lm.VOCAB, tied_lm.HIDDEN)


def _te_files():
    spec = importlib.util.spec_from_file_location("te_files", Path(__file__).parent.parent / "te_files.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=[pytest.param(True, id="te"), pytest.param(False, id="no_te")])
def te_dummy(request, monkeypatch):
    """TE's own cached ``get_dummy_wgrad`` in megatron's layers module (``HAVE_TE``), or
    megatron's no-TE ``torch.zeros``; yields TE's cache (or None)."""
    if not request.param:
        yield None
        return
    te_files = _te_files()
    if not te_files.te_root(TE_VERSION).exists():
        pytest.skip(f"TE {TE_VERSION}'s files not fetched: run python compat/te_sources.py")
    base = te_files.install_te_modules(TE_VERSION, monkeypatch.setitem)["base"]
    from megatron.core.tensor_parallel import layers

    monkeypatch.setattr(layers, "HAVE_TE", True)
    monkeypatch.setattr(layers, "get_dummy_wgrad", base.get_dummy_wgrad, raising=False)
    yield base._dummy_wgrads


def output_sized_bf16(model) -> list:
    """bf16 tensors of the output layer's shape alive now, other than parameters and views of
    the model's."""
    gc.collect()
    owned = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not isinstance(o, torch.nn.Parameter)
            and o.dtype == torch.bfloat16 and tuple(o.shape) == SHAPE and o.untyped_storage().data_ptr() not in owned]


WITH_TE = pytest.mark.parametrize("te_dummy", [pytest.param(True, id="te")], indirect=True)


@WITH_TE  # without TE megatron's zeros are a fresh tensor per backward: nothing to hold
@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("tied, mtp", CASES)
def test_no_output_layer_sized_tensor_outlives_the_step(parallel, shared_on, te_dummy, tied, mtp,  # noqa: F811
                                                        distributed):
    target, module = shared_on
    model, got, ref, _ = train(module, tied=tied, mtp=mtp, distributed=distributed,
                               upstream_failure_skips=not keeps_weight_arguments(target, module))
    for name in got:
        assert rel(got[name], ref[name]) < TOL, (name, rel(got[name], ref[name]))
    left = output_sized_bf16(model)
    assert not left, f"{len(left)} bf16 tensor(s) of {SHAPE} held after the step"
    if te_dummy is not None:
        assert (*SHAPE, torch.bfloat16) not in te_dummy, "TE's per-shape cache was filled"


@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("mtp", [pytest.param(False, id="tied"), pytest.param(True, id="tied_mtp")])
def test_the_gradients_are_bitwise_those_with_megatrons_zeros(parallel, shared_on, te_dummy, mtp,  # noqa: F811
                                                              distributed, monkeypatch):
    target, module = shared_on
    kwargs = dict(tied=True, mtp=mtp, distributed=distributed, micro_batches=3,
                  upstream_failure_skips=not keeps_weight_arguments(target, module))
    given = []
    original = fsdp_wgrad.broadcast_zero
    monkeypatch.setattr(fsdp_wgrad, "broadcast_zero", lambda *args: given.append(original(*args)) or given[-1])
    _, broadcast, _, _ = train(module, **kwargs)
    assert given and all(z is not None and z.stride() == (0, 0) for z in given), "the broadcast zeros never ran"
    monkeypatch.setattr(fsdp_wgrad, "broadcast_zero", lambda param, shape, dtype: None)
    _, full, _, _ = train(module, **kwargs)
    assert broadcast.keys() == full.keys()
    for name in full:
        assert torch.equal(broadcast[name].view(torch.int64), full[name].view(torch.int64)), name


def allocated_during(fn) -> tuple[int, int]:
    """(peak, end) of the CPU memory allocated while ``fn`` runs, above what was allocated when
    it began (the profiler's allocation events carry the allocator's running total)."""
    profiler = pytest.importorskip("torch._C._profiler")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()

    def walk(events):
        for event in events:
            yield event
            yield from walk(event.children)

    allocations = sorted((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated)
                         for e in walk(prof.profiler.kineto_results.experimental_event_tree())
                         if e.tag == profiler._EventType.Allocation)
    assert allocations, "the profiler recorded no allocation"
    base = allocations[0][2] - allocations[0][1]
    return max(total for _, _, total in allocations) - base, allocations[-1][2] - base


def memory_of_two_steps(module, *, fusion: bool) -> tuple[int, int]:
    torch.manual_seed(0)
    model = tied_lm.TiedLM(tied=True, mtp=False)
    model.output_layer.gradient_accumulation_fusion = fusion
    obj = tied_lm.wrap(module, model, distributed=False)
    gen = torch.Generator().manual_seed(1)

    def steps():
        for _ in range(2):
            for _ in range(2):  # micro-batches
                tokens = torch.randint(0, tied_lm.VOCAB, (tied_lm.BATCH, tied_lm.SEQ), generator=gen)
                logits = obj.module(tokens)
                torch.autograd.backward(logits, [torch.randn(lg.shape, generator=gen).to(lg.dtype) for lg in logits])
                del logits
            for p in model.parameters():
                p._gbuf.data.zero_()
            gc.collect()

    return allocated_during(steps)


@WITH_TE
def test_peak_and_held_memory_are_at_most_fusion_offs(parallel, shared_on, te_dummy, monkeypatch):  # noqa: F811
    """The persistent buffer (one data-parallel rank, as on the H200 measurement). A fresh
    bucket (sharded, several ranks) is fetched by the fused write in the output layer's backward
    and lives until the weight's ``_grad_acc`` at the end of the backward, where fusion off
    fetches it only then: fusion's own timing, with or without any dummy, not tested here."""
    _, module = shared_on
    monkeypatch.setattr(tied_lm, "VOCAB", 512)  # the dummy larger than anything else of the step
    monkeypatch.setattr(tied_lm, "HIDDEN", 256)
    fused_peak, fused_end = memory_of_two_steps(module, fusion=True)
    off_peak, off_end = memory_of_two_steps(module, fusion=False)
    assert fused_end <= off_end, f"fused holds {fused_end - off_end} B more than fusion off after the steps"
    assert fused_peak <= off_peak, f"fused peak {fused_peak - off_peak} B above fusion off's"


def test_the_zeros_are_one_broadcast_element_of_the_weights_device():
    weight = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))

    def ask():
        return asked_in_backward(weight, lambda: fsdp_wgrad.broadcast_zero(weight, [6, 4], torch.bfloat16))

    assert ask() is None, "not a Megatron-FSDP parameter"
    weight.__fsdp_param__ = True
    assert fsdp_wgrad.broadcast_zero(weight, [6, 4], torch.bfloat16) is None, "outside a backward into .grad"
    zeros = ask()
    assert zeros.shape == (6, 4) and zeros.dtype == torch.bfloat16 and zeros.stride() == (0, 0)
    assert zeros.untyped_storage().nbytes() == 2 and torch.count_nonzero(zeros) == 0
    with pytest.raises(RuntimeError):
        zeros.add_(1)  # a write into it raises, it never lands anywhere
    with torch.autograd.detect_anomaly(check_nan=True):
        assert ask() is None


def halving_hooks(monkeypatch) -> None:
    """Every parameter of the models ``train`` builds gets a tensor hook that halves its
    gradient in place, as some clipping or scaling code does."""

    class Hooked(tied_lm.TiedLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for p in self.parameters():
                p.register_hook(lambda g: g.mul_(0.5))

    monkeypatch.setattr(tied_lm, "TiedLM", Hooked)


@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("tied, mtp", CASES)
def test_an_in_place_tensor_hook_sees_megatrons_dummy_never_main_grad(parallel, shared_on, te_dummy, tied, mtp,  # noqa: F811
                                                                      distributed, monkeypatch):
    """0.4.0 gave a weight with a tensor hook the view of its main_grad (or the broadcast zeros)
    as its dummy: ``g.mul_(0.5)`` wrote into main_grad. Each gradient must be bitwise what it is
    with megatron's own dummy (the hook changes only what upstream's changes)."""
    target, module = shared_on
    kwargs = dict(tied=tied, mtp=mtp, distributed=distributed, micro_batches=2,
                  upstream_failure_skips=not keeps_weight_arguments(target, module))
    halving_hooks(monkeypatch)
    _, ours, _, _ = train(module, **kwargs)
    monkeypatch.setattr(fsdp_wgrad, "main_grad_alias", lambda *args: None)
    monkeypatch.setattr(fsdp_wgrad, "broadcast_zero", lambda *args: None)
    _, megatrons, _, _ = train(module, **kwargs)
    for name in megatrons:
        same = torch.equal(ours[name].view(torch.int64), megatrons[name].view(torch.int64))
        assert same, (name, rel(ours[name], megatrons[name]))


@pytest.mark.parametrize("distributed", BUFFERS)
def test_without_hooks_the_untied_output_layer_still_gets_the_view(parallel, shared_on, distributed,  # noqa: F811
                                                                   monkeypatch):
    """The memory the view saves stays where no hook can see the dummy."""
    target, module = shared_on
    given = []
    original = fsdp_wgrad.main_grad_alias
    monkeypatch.setattr(fsdp_wgrad, "main_grad_alias", lambda *args: given.append(original(*args)) or given[-1])
    train(module, tied=False, mtp=False, distributed=distributed,
          upstream_failure_skips=not keeps_weight_arguments(target, module))
    assert given and all(view is not None for view in given), "the view was not given"
