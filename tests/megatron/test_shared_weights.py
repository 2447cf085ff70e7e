"""A weight used more than once in one backward, with gradient-accumulation fusion on, under
Megatron-FSDP's real post-backward hook.

Runs per megatron-core release (compat/matrix.py puts it on PYTHONPATH); where the standalone
megatron-fsdp package is importable too (PYTHONPATH=compat/.cache/mfsdp-X:...), its copy of
MegatronFSDP is tested the same way.

What is real: megatron's ``VocabParallelEmbedding`` and ``ColumnParallelLinear`` (the output
layer, weight passed in as ``GPTModel`` does for tied embeddings) with
``gradient_accumulation_fusion=True``; the release's ``MegatronFSDP._register_fsdp_hooks``
(patched or not), which registers the real hooks: the pre-forward unshard, the per-parameter
post-accumulate-grad hook running the nested ``_grad_acc``, the root pre/post-backward hooks;
``all_gather_and_wait_parameters_ready`` (it resets ``grad_added_to_main_grad`` on every
unshard). What stands in (a real MegatronFSDP needs CUDA and process groups): the instance is
made with ``object.__new__`` and holds only what those methods read; each parameter's gradient
buffer is a ``GradBuffer`` with Megatron-FSDP's ``fetch_bucket`` semantics (persistent view, or
one unzeroed, NaN-poisoned bucket per bucket id until it is reduced) and a reduce pipeline that,
like Megatron-FSDP's, reduces a bucket once every parameter of its group is marked ready and adds
it into the persistent shard, then frees it.

The oracle is plain fp64 autograd of the same computation. The bf16 activations make the
patched result differ from it by ~1e-3; a lost embedding or output-layer gradient by > 0.2.
"""

from __future__ import annotations

import gc
import importlib
import logging
import types

import megatron_cpu
import pytest
from conftest import EXPECTED, torch

import gemm_patch
from gemm_patch.engine import config, detection
from gemm_patch.engine.callsite import fingerprint, parse_method
from gemm_patch.targets import shared_grad
from gemm_patch.upstream import fsdp_rules

# The layouts a test here repeats its check over (the model's ties, the buffer, the buckets): the
# matrix's quick releases, whose recorded code equals a whole-folder release's, run the first of
# each (compat/matrix_quick.py); the tests of test_embedding_wgrad.py and others take it too.
LAYOUTS = pytest.mark.sweep("tied", "mtp", "distributed", "buckets")
pytestmark = [pytest.mark.proves("fsdp-wgrad", "fsdp-shared-grad", "mfsdp-shared-grad"), LAYOUTS]

ATTR = "_register_fsdp_hooks"
TOL = 1e-2  # bf16 activations and embedding gradient: <= 3e-3 seen; a lost use is > 0.2 (asserted below)


def _import(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


MODULES = {t.name: (t, _import(t.module)) for t in (shared_grad.TARGET, shared_grad.STANDALONE)}
MODULES = {n: (t, m) for n, (t, m) in MODULES.items() if m is not None and hasattr(m, "MegatronFSDP")}


PATCHED = ("verified", "compatible", "forced")  # forced: compat/adopt.py opens the gate for new code


def expected_state(target) -> str:
    return EXPECTED.get(target.name) or target.expected_state(detection.distribution_version(target.distribution))


TESTED = [n for n, (t, _) in MODULES.items() if expected_state(t) in PATCHED]
needs_code = pytest.mark.skipif(not TESTED, reason="no Megatron-FSDP _grad_acc with the statement here")


@pytest.fixture(params=TESTED)
def fsdp(request):
    return MODULES[request.param]


def _ours(target, module) -> bool:
    return getattr(vars(module.MegatronFSDP)[ATTR], "_self_gemm_patch_target", None) == target.name


@pytest.fixture
def shared_on(fsdp):
    """The target installed (through the registry where it is listed, directly otherwise)."""
    target, module = fsdp
    gemm_patch.apply()
    undo = None
    if not _ours(target, module):
        st, undo = target.patch(module, detection.distribution_version(target.distribution), config.load())
        assert st.state in PATCHED, st.reason
    assert _ours(target, module)
    yield fsdp
    if undo is not None:
        assert undo.run() == []


@pytest.fixture
def shared_off(fsdp, monkeypatch):
    """Upstream's method in place (what GEMM_PATCH_SHARED_GRAD=0, or a MegatronFSDP built before
    ``apply()``, leaves), every other fix applied."""
    target, module = fsdp
    gemm_patch.apply()
    live = vars(module.MegatronFSDP)[ATTR]
    if _ours(target, module):
        monkeypatch.setattr(module.MegatronFSDP, ATTR, live.__wrapped__)
    yield fsdp
    # The instances built here run upstream's hooks: once the test drops them (``run`` removed
    # their hooks) they are garbage in a cycle, collected now so that no later apply() finds them.
    gc.collect()


@pytest.fixture(autouse=True)
def cpu_dummy_wgrad(monkeypatch):
    # Without TE, megatron allocates the dummy wgrad it returns on torch.cuda.current_device().
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.fixture(scope="module")
def parallel():
    with megatron_cpu.model_parallel():
        yield


# -- Megatron-FSDP's side, as its methods see it --------------------------------------------


class GradBuffer:
    """One parameter group's gradient buffer (``DataParallelBuffer``) over the group's parameters,
    each an item at its offset: ``fetch_bucket`` returns the persistent storage when the data is
    not distributed, else the bucket of this bucket id, allocated unzeroed (NaN here) on first
    use and kept until the pipeline frees it (``free_bucket_storage``, which also sets each
    parameter's ``main_grad`` to None)."""

    def __init__(self, params, distributed: bool):
        self.is_data_distributed = distributed
        self.dtype = torch.float32
        self.params = list(params)
        self.offsets, total = {}, 0
        for p in self.params:
            self.offsets[p] = (total, p.numel())
            total += p.numel()
        self.data = torch.zeros(total, dtype=torch.float32)  # zero_grad_buffer()
        self.bucket = None
        self.fetches = 0

    def fetch_bucket(self, dtype=None):
        self.fetches += 1
        if not self.is_data_distributed:
            return self.data
        if self.bucket is None:
            self.bucket = torch.full_like(self.data, float("nan"))
        return self.bucket

    def item(self, flat, param):
        """``get_item_from_bucket``: the parameter's slice of a bucket (or of ``data``)."""
        start, n = self.offsets[param]
        return flat[start:start + n].view(param.shape)

    def reduce(self):
        """Reduce-scatter on one rank: the bucket (fetched, as upstream does: a freed one comes
        back unzeroed) is added into the persistent shard."""
        if self.is_data_distributed:
            self.data += self.fetch_bucket()

    def free_bucket_storage(self):
        if self.is_data_distributed:
            self.bucket = None
            for p in self.params:
                p.main_grad = None


class ReducePipeline:
    """``GradReducePipeline``'s schedule: ``reduce_gradients`` marks parameters ready and
    reduces a group once all of its parameters are; the bucket is freed (and the group's
    ready set emptied) only when a later reduce needs the queue's room or at ``reset``. The queue
    keeps ``keep`` reduced buckets; None: all of them, as MegatronFSDP's default queue capacity
    (``suggested_communication_unit_size``, at least 1e9 elements) does for any model that fits
    here. So a bucket can be reduced and still be fetched (None), or freed by a later reduce and
    fetched again, unzeroed (0)."""

    def __init__(self, groups, keep: int | None = None):
        self.groups, self.reduced, self.queue = groups, [], []
        self.ready = {g.name: set() for g in groups}
        self.keep = keep
        self.group_of = {p: g for g in groups for p in g.params}
        self.handed: dict = {}  # param -> how many times it was marked ready

    def reduce_gradients(self, params, **kwargs):
        for p in params:
            self.handed[p] = self.handed.get(p, 0) + 1
            group = self.group_of[p]
            self.ready[group.name].add(p)
            if len(self.ready[group.name]) < len(group.params):
                continue
            while self.keep is not None and len(self.queue) > self.keep:
                self.queue.pop(0)()
            if group.gbuf.is_data_distributed:
                group.gbuf.reduce()
                self.reduced.append(group.name)
            self.queue.append(lambda g=group: (self.ready[g.name].clear(), g.gbuf.free_bucket_storage()))

    def reset(self):
        while self.queue:
            self.queue.pop(0)()
        assert not any(self.ready.values()), f"parameters left ready but never reduced: {self.ready}"

    def _enforce_double_buffer_limit(self, *args):
        pass


class AllGatherPipeline:
    def __init__(self, num_buckets: int = 0):
        self.gathered, self.num_buckets, self.bucket_can_be_released = 0, num_buckets, {}

    def all_gather_params(self, params, **kwargs):
        self.gathered += 1
        self.backward_gathers = getattr(self, "backward_gathers", 0) + bool(kwargs.get("bwd"))

    def wait_bucket_ready(self, *args, **kwargs):
        pass

    def release_bucket(self, *args, **kwargs):
        pass


def fsdp_param(param, gbuf: GradBuffer, item_id: int):
    """The attributes Megatron-FSDP gives a parameter (``__fsdp_param__``, ``_gbuf``,
    ``_item_id``, ``get_main_grad``, ``grad_added_to_main_grad``)."""
    param.__fsdp_param__ = True
    param.grad_added_to_main_grad = False
    param._gbuf = gbuf
    param._item_id = item_id
    param.get_main_grad = lambda: param._gbuf.item(param._gbuf.fetch_bucket(), param)


BUCKETS = ("own", "shared")


def wrap(module_fsdp, root: torch.nn.Module, distributed: bool, strategy: str | None = None,
         fine_grained: bool = False, buckets: str = "own", keep: int | None = None, cls: type | None = None):
    """A MegatronFSDP over ``root`` without __init__, holding what ``_register_fsdp_hooks`` and
    the hooks it registers read; then the release's (possibly patched) ``_register_fsdp_hooks``.
    ``fine_grained``: ``enable_fine_grained_param_gather_hook`` (and 0.19's backward twin of it),
    an unshard hook before every module's forward and backward. ``buckets``: ``own``, one
    parameter group (bucket) per parameter; ``shared``, one for all, as ``_get_parameter_groups``
    groups parameters of one dtype outside FSDP units (the embedding and the output layer).
    ``keep``: reduced buckets the reduce pipeline keeps before freeing (``ReducePipeline``).
    ``cls``: a subclass of the release's MegatronFSDP to build instead."""
    if buckets not in BUCKETS:
        raise ValueError(f"buckets={buckets!r}: one of {BUCKETS}")
    obj = object.__new__(cls or module_fsdp.MegatronFSDP)
    torch.nn.Module.__init__(obj)
    params = [p for p in root.parameters() if p.requires_grad]
    members = [[p] for p in params] if buckets == "own" else [params]
    groups = []
    for i, group_params in enumerate(members):
        gbuf = GradBuffer(group_params, distributed)
        for item_id, p in enumerate(group_params):
            fsdp_param(p, gbuf, item_id)
        # hsdp_gbuf (0.14-0.16) / hfsdp_helper_gbuf (0.17+): None without hybrid sharding.
        groups.append(types.SimpleNamespace(name=i, params=group_params, requires_grad=True,
                                            hfsdp_helper_gbuf=None, hsdp_gbuf=None, main_grad_buffer=gbuf,
                                            gbuf=gbuf, fsdp_unit_id=None, is_expert_param=False))
    strategy = strategy or ("optim_grads" if distributed else "no_shard")
    buffer = types.SimpleNamespace(param_to_param_group={p: i for i, g in enumerate(members) for p in g},
                                   parameter_groups=groups)
    ddp_config = types.SimpleNamespace(
        data_parallel_sharding_strategy=strategy, keep_fp8_transpose_cache=True, fsdp_double_buffer=False,
        outer_dp_sharding_strategy="no_shard", fsdp_manual_registration=False,
        # Read by main's hooks (reduce in the hook where it overlaps, as Megatron-FSDP sets it).
        overlap_grad_reduce=True,
    )
    vars(obj).update(
        ddp_config=ddp_config, data_parallel_sharding_strategy=strategy,
        param_and_grad_buffer=buffer, param_to_name={p: f"p{i}" for i, p in enumerate(params)},
        grad_reduce_pipeline=ReducePipeline(groups, keep), all_gather_pipeline=AllGatherPipeline(len(groups)),
        fsdp_unit_modules=[], enable_fine_grained_param_gather_hook=fine_grained,
        enable_fine_grained_param_gather_backward_hook=fine_grained, fine_grained_recurse_module_types=(),
        dist_index=types.SimpleNamespace(use_hybrid_fsdp=False), report_nan_in_param_grad=False,
        model_auto_sync=False, microbatch_count=0, suggested_RS_queue_capacity=None,
        suggested_AG_prefetch_size=None, is_param_fsdp_distributed=True, is_last_microbatch=True,
    )
    obj.module = root  # a registered submodule, as MegatronFSDP.__init__ sets it
    obj._register_fsdp_hooks(root)
    return obj


# -- the model: megatron's real layers --------------------------------------------------------

VOCAB, HIDDEN, SEQ, BATCH = 48, 32, 6, 2


class TiedLM(torch.nn.Module):
    """What GPTModel does with tied embeddings: the embedding owns the weight, the output layer
    is a ColumnParallelLinear built with ``skip_weight_param_allocation`` and given that weight
    at forward; ``LanguageModule`` sets ``zero_out_wgrad`` on it (pipeline size 1). ``mtp``:
    one more use of each, as a multi-token-prediction layer makes (embedding of the shifted
    tokens, projected by a layer of its own, ``eh_proj``, whose post-backward hook and bucket
    reduce run between the output layer's two uses; output projection of its hidden states with
    the same weight). ``tied=False``:
    an output layer with its own weight, used by the main and the MTP head alike.
    ``checkpoint``: the MTP head under ``torch.utils.checkpoint`` (``reentrant`` or
    ``non_reentrant``), recomputed in the backward. ``fusion=False``: gradient-accumulation
    fusion off (every gradient through ``param.grad``), the other oracle."""

    CHECKPOINTS = ("none", "reentrant", "non_reentrant")

    def __init__(self, tied: bool = True, mtp: bool = False, checkpoint: str = "none", fusion: bool = True):
        super().__init__()
        from megatron.core.tensor_parallel import layers

        cfg = megatron_cpu.config(fusion=fusion)
        self.config = cfg  # as GPTModel keeps it (MegatronModule): the model's gradient_accumulation_fusion
        self.embedding = layers.VocabParallelEmbedding(VOCAB, HIDDEN, init_method=torch.nn.init.normal_, config=cfg)
        self.output_layer = layers.ColumnParallelLinear(
            HIDDEN, VOCAB, config=cfg, init_method=torch.nn.init.normal_, bias=False, gather_output=False,
            skip_weight_param_allocation=tied)
        if checkpoint not in self.CHECKPOINTS:
            raise ValueError(f"checkpoint={checkpoint!r}: one of {self.CHECKPOINTS}")
        self.tied, self.mtp, self.checkpoint = tied, mtp, checkpoint
        if mtp:
            self.eh_proj = layers.ColumnParallelLinear(
                HIDDEN, HIDDEN, config=cfg, init_method=torch.nn.init.normal_, bias=False, gather_output=False)
        if tied:
            self.embedding.weight.zero_out_wgrad = True  # language_module.py, pipeline size 1

    def output_weight(self):
        return self.embedding.weight if self.tied else None

    def forward(self, tokens):
        h = self.embedding(tokens)  # [b, s, h]
        logits = [self.output_layer(h, weight=self.output_weight())[0]]
        if self.mtp:
            shifted = tokens.roll(-1, dims=1)
            if self.checkpoint == "none":
                logits.append(self.mtp_head(h, shifted))
            else:
                from torch.utils.checkpoint import checkpoint

                logits.append(checkpoint(self.mtp_head, h, shifted, use_reentrant=self.checkpoint == "reentrant"))
        return logits

    def mtp_head(self, h, shifted):
        h2 = self.eh_proj(self.embedding(shifted))[0] + 0.5 * h
        return self.output_layer(h2, weight=self.output_weight())[0]


def reference(model: TiedLM, tokens_list, grads_list) -> dict[str, torch.Tensor]:
    """Plain fp64 autograd of the same computation: every parameter's gradient, summed over
    the micro-batches."""
    params = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    emb = params["embedding.weight"]
    out = emb if model.tied else params["output_layer.weight"]
    for tokens, grads in zip(tokens_list, grads_list, strict=True):
        h = emb[tokens]
        logits = [h @ out.t()]
        if model.mtp:
            h2 = emb[tokens.roll(-1, dims=1)] @ params["eh_proj.weight"].t() + 0.5 * h
            logits.append(h2 @ out.t())
        sum((lg * g.double()).sum() for lg, g in zip(logits, grads, strict=True)).backward()
    return {n: p.grad for n, p in params.items()}


def keeps_weight_arguments(target, module) -> bool:
    """Whether the installed method is the twin that keeps Megatron-FSDP parameters out of the
    identity Function (the 0.14-0.15 code, ``param_arg_fingerprints``)."""
    live = vars(module.MegatronFSDP)[ATTR]
    return (getattr(live, "_self_gemm_patch_target", None) == target.name
            and fingerprint(parse_method(module, target.owner, target.attribute)) in target.param_arg_fingerprints)


MICRO_BATCHES = 2


def train(module_fsdp, *, tied: bool, mtp: bool, distributed: bool, micro_batches: int = MICRO_BATCHES, seed: int = 0,
          upstream_failure_skips: bool = True, checkpoint: str = "none", fusion: bool = True, **wrap_kwargs):
    """Forward/backward ``micro_batches`` times through MegatronFSDP's hooks; returns the
    model, each parameter's reduced gradient and the fp64 reference. ``wrap_kwargs``: ``wrap``'s."""
    torch.manual_seed(seed)
    model = TiedLM(tied, mtp, checkpoint, fusion)
    obj = wrap(module_fsdp, model, distributed, **wrap_kwargs)
    return run(model, obj, micro_batches=micro_batches, seed=seed, upstream_failure_skips=upstream_failure_skips)


def run(model: TiedLM, obj, *, micro_batches: int = MICRO_BATCHES, seed: int = 0, upstream_failure_skips: bool = True):
    """``train``'s micro-batches through a MegatronFSDP ``obj`` already built over ``model``;
    its hooks are removed afterwards (``remove_hooks``)."""
    try:
        return _micro_batches(model, obj, micro_batches, seed, upstream_failure_skips)
    finally:
        remove_hooks(obj)


def remove_hooks(obj) -> None:
    """Every hook the MegatronFSDP ``obj`` registered and kept a handle of, removed, as at the
    end of training. torch holds a parameter's hooks where the collector does not look, so an
    instance whose hooks stay would live as long as the process, and one built under megatron's
    own hooks would make every later apply() report it."""
    from torch.utils.hooks import RemovableHandle

    for value in list(vars(obj).values()):
        for handle in (value.values() if isinstance(value, dict) else (value,)):
            if isinstance(handle, RemovableHandle):
                handle.remove()
    # megatron-core 0.14-0.15 register tensor hooks on the parameters at each forward
    # (register_multi_grad_hook) and keep no handle: torch keeps them in _backward_hooks.
    for param in obj.module.parameters():
        if param._backward_hooks:
            param._backward_hooks.clear()


def _micro_batches(model: TiedLM, obj, micro_batches: int, seed: int, upstream_failure_skips: bool):
    tied = model.tied
    gen = torch.Generator().manual_seed(seed + 1)
    tokens_list, grads_list = [], []
    for _ in range(micro_batches):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        logits = obj.module(tokens)
        grads = [torch.randn(lg.shape, generator=gen).to(lg.dtype) for lg in logits]
        try:
            torch.autograd.backward(logits, grads)
        except AttributeError as exc:
            if upstream_failure_skips and tied and "'NoneType' object has no attribute 'dtype'" in str(exc):
                # megatron-core 0.14-0.15 / megatron-fsdp 0.1-0.2 register a post-backward hook
                # on every module that passes its tensor arguments through an identity autograd
                # Function, so the tied weight reaches the output layer as a non-leaf tensor
                # without __fsdp_param__ or main_grad and megatron's fused branch fails
                # (validation/notes/tied-weights.md): upstream. The target keeps the parameter out of it on the code
                # it knows (param_arg_fingerprints); elsewhere there is no fused write to fix.
                pytest.skip("tied weight passed through RegisterFSDPBackwardFunction: megatron's "
                            "fused wgrad fails upstream on this release")
            raise
        tokens_list.append(tokens)
        grads_list.append(grads)
    got = {n: p._gbuf.item(p._gbuf.data, p).double() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        assert p._gbuf.bucket is None, f"{n}: bucket never reduced"
        assert p.grad is None, f"{n}: param.grad left behind"
    return model, got, reference(model, tokens_list, grads_list), obj


def rel(got, ref) -> float:
    return ((got - ref).norm() / ref.norm()).item()


CASES = [
    pytest.param(True, False, id="tied"),
    pytest.param(True, True, id="tied_mtp"),
    pytest.param(False, True, id="untied_mtp"),  # output weight written twice, no zero_out_wgrad
    pytest.param(False, False, id="untied"),
]
BUFFERS = [pytest.param(False, id="persistent"), pytest.param(True, id="fresh")]


@needs_code
@pytest.mark.parametrize("buckets", BUCKETS)
@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("tied, mtp", CASES)
def test_every_parameter_matches_fp64_autograd(parallel, shared_on, tied, mtp, distributed, buckets):
    target, module = shared_on
    model, got, ref, obj = train(module, tied=tied, mtp=mtp, distributed=distributed, buckets=buckets,
                                 upstream_failure_skips=not keeps_weight_arguments(target, module))
    if distributed:
        assert obj.grad_reduce_pipeline.reduced, "no bucket was reduced"
    for name in got:
        assert not torch.isnan(got[name]).any(), f"{name}: stale bucket memory reached the gradient"
        assert rel(got[name], ref[name]) < TOL, (name, rel(got[name], ref[name]))
    # Each gradient is handed to the reduce once per backward, after all its uses (0.14-0.15's
    # per-module-call hook included: a weight with a use still to come waits for it).
    handed = obj.grad_reduce_pipeline.handed
    assert all(handed.get(p) == MICRO_BATCHES for p in model.parameters()), \
        {n: handed.get(p) for n, p in model.named_parameters()}


def per_module_call_hooks(target, module) -> bool:
    """Whether this release's hooks run ``_grad_acc`` and the reduce after each module call
    (megatron-core 0.14-0.15, megatron-fsdp 0.1-0.2: the code of ``param_arg_fingerprints``)."""
    return fingerprint(parse_method(module, target.owner, target.attribute)) in target.param_arg_fingerprints


@needs_code
@pytest.mark.parametrize("keep", [pytest.param(0, id="freed"), pytest.param(None, id="kept")])
@pytest.mark.parametrize("buckets", BUCKETS)
def test_under_upstream_hooks_a_write_never_adds_into_another_bucket(parallel, shared_off, buckets, keep, caplog,
                                                                      monkeypatch):
    """A MegatronFSDP built before ``gemm_patch.apply()`` (or under GEMM_PATCH_SHARED_GRAD=0)
    keeps upstream's hooks while fsdp-wgrad writes the output layer's gradient, used twice per
    backward (MTP), into a fresh bucket. On 0.14-0.15 upstream's ``_grad_acc`` and the bucket's
    reduce run between the two uses: the bucket may be reduced and kept (``kept``: adding would
    count the first use twice), or freed and fetched again unzeroed (``freed``: adding gave
    NaN). gemm-patch cannot tell those from a bucket shared with parameters still to come
    (``shared``, where upstream's own overwrite loses the first use): the record decides
    nothing there, the write overwrites as megatron's does, and one WARNING line says so. On
    0.16+ the hooks run after every use and megatron's flag survives between them: no warning."""
    target, module = shared_off
    # fsdp-wgrad, or fsdp-wgrad-gemm on Megatron-LM main: whichever form the release has.
    assert any(s.state in PATCHED for s in gemm_patch.status().targets if s.name.startswith("fsdp-wgrad")), \
        gemm_patch.status().targets
    monkeypatch.setattr(fsdp_rules, "_warned", set())
    log = logging.getLogger("gemm_patch")  # its own handler, propagate off: caplog's is added to it
    log.addHandler(caplog.handler)
    try:
        model, got, ref, _ = train(module, tied=False, mtp=True, distributed=True, buckets=buckets, keep=keep)
    finally:
        log.removeHandler(caplog.handler)
    name = "output_layer.weight"
    error = rel(got[name], ref[name])
    assert not torch.isnan(got[name]).any(), "a record of an earlier bucket made the write add into a fresh one"
    warnings = [r for r in caplog.records if "written twice in one backward" in r.getMessage()]
    if not per_module_call_hooks(target, module):
        assert error < TOL and not warnings, (error, [r.getMessage() for r in warnings])
        return
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert "MegatronFSDP built before gemm_patch.apply()" in warnings[0].getMessage()
    if buckets == "own":
        assert error < TOL, error  # megatron's overwrite is right here: the first use was reduced
    else:
        assert error > 0.2, error  # upstream's loss, which the warning names


@needs_code
@pytest.mark.parametrize("distributed", BUFFERS)
@pytest.mark.parametrize("tied, mtp", [c for c in CASES if c.values[0]])
def test_without_the_target_the_embedding_gradient_is_lost(parallel, shared_off, tied, mtp, distributed):
    """Upstream's _grad_acc deletes param.grad of a tied weight: what the test above catches."""
    _, module = shared_off
    model, got, ref, _ = train(module, tied=tied, mtp=mtp, distributed=distributed)
    error = rel(got["embedding.weight"], ref["embedding.weight"])
    assert error > 0.2, error
    assert error < 1.5


@needs_code
@pytest.mark.parametrize("distributed", BUFFERS)
def test_without_the_target_a_tied_weight_argument_fails_on_0_14_0_15(parallel, shared_off, distributed):
    """On the code that passes weight arguments through the identity Function, upstream's fused
    branch finds no main_grad on the tied weight: what the target's second edit prevents."""
    target, module = shared_off
    if fingerprint(parse_method(module, target.owner, target.attribute)) not in target.param_arg_fingerprints:
        pytest.skip("this release hands the tied weight over as the parameter itself")
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'dtype'"):
        train(module, tied=True, mtp=False, distributed=distributed, upstream_failure_skips=False)


@needs_code
def test_second_edit_only_on_the_recorded_code(shared_on):
    """The status says which edits the twin made; the argument edit only where recorded."""
    target, module = shared_on
    st = next(s for s in gemm_patch.status().targets if s.name == target.name) \
        if target.name in {s.name for s in gemm_patch.status().targets} else None
    recorded = fingerprint(parse_method(module, target.owner, target.attribute)) in target.param_arg_fingerprints
    assert keeps_weight_arguments(target, module) == recorded
    if st is not None and st.state == "verified":
        assert (shared_grad.ARG_HOOK in st.reason) == recorded, st.reason


@needs_code
def test_the_twin_changes_one_statement_and_reverts_by_identity(shared_on):
    target, module = shared_on
    installed = vars(module.MegatronFSDP)[ATTR]
    original = installed.__wrapped__
    assert original.__name__ == ATTR and installed.__name__ == ATTR
    twin = installed._self_gemm_patch_twin
    assert twin.__code__.co_filename == original.__code__.co_filename
    assert twin.__code__.co_firstlineno == original.__code__.co_firstlineno
    assert shared_grad.CELL in twin.__code__.co_cellvars + twin.__code__.co_freevars or \
        any(shared_grad.CELL in getattr(c, "co_freevars", ()) for c in twin.__code__.co_consts
            if isinstance(c, types.CodeType))
    assert not hasattr(module, shared_grad.CELL), "the module gained a name"


@needs_code
def test_switch_turns_it_off(fsdp, monkeypatch):
    target, module = fsdp
    monkeypatch.setenv("GEMM_PATCH_SHARED_GRAD", "0")
    cfg = config.load(switches=(target.switch_variable,))
    st, undo = target.patch(module, detection.distribution_version(target.distribution), cfg)
    assert st.state == "off" and "GEMM_PATCH_SHARED_GRAD=0" in st.reason
    assert undo.steps == []


def test_state_per_release():
    """verified where the release has the statement (fingerprint recorded), not applicable
    where there is no Megatron-FSDP module (0.13.x)."""
    for target, module in MODULES.values():
        version = detection.distribution_version(target.distribution)
        funcdef = parse_method(module, target.owner, target.attribute)  # the source, patched or not
        if target.expected_state(version) == "verified":
            assert target.fingerprints[version.split("+")[0]] == fingerprint(funcdef)
            shared_grad._site(funcdef)  # exactly one statement to change
    core = _import("megatron.core")
    if core is not None and shared_grad.TARGET.name not in MODULES:
        assert shared_grad.TARGET.expected_state(detection.distribution_version("megatron-core")) == "not applicable"


def test_registered():
    from gemm_patch.targets import REGISTRY

    assert {"fsdp-shared-grad", "mfsdp-shared-grad"} <= {t.name for t in REGISTRY}

