"""GEMM_PATCH_EMBEDDING_WGRAD: the embedding lookup's weight gradient written straight into a
Megatron-FSDP weight's fp32 ``main_grad``.

fsdp-embedding-wgrad: megatron-core's ``F.embedding(masked_input, self.weight)`` (``weight``
on 0.19+) in ``VocabParallelEmbedding.forward``, sent to ``fsdp_embedding``.

The lookup's gradient is a sum of the output gradient's rows, one per token. Autograd makes it
a dense ``[vocab, hidden]`` bf16 tensor every micro-batch (1 GiB at 128256 x 4096), which
Megatron-FSDP then adds into ``main_grad``; on a tied weight it is first summed with the output
layer's zero dummy. For a Megatron-FSDP parameter whose hooks are fsdp-shared-grad's twin, the
stand-in instead adds the rows into ``main_grad`` in fp32 (``index_add_``; written over first
where the bucket is fresh and nothing of this backward is in it yet, the rule of the fused linear,
``wgrad_accumulates``), sets ``grad_added_to_main_grad`` and returns a broadcast zero as the
weight's gradient, only so that autograd runs Megatron-FSDP's hook.

Whatever else reaches ``param.grad`` (another, plain use of the weight, a zero dummy) is added
into ``main_grad`` by the twin's ``_grad_acc``, as megatron does for a ``zero_out_wgrad`` weight
(``lookup_written``). Where one recorded zero dummy alone is what autograd is about to
accumulate (``_only_zeros_prehook``, a pre-hook of the weight's AccumulateGrad node), nothing is
added and no full-size zeros are made. Elsewhere (bf16 main grads, a parameter of other hooks or
none, a weight with a tensor hook or a post-accumulate-grad hook of its own, which must see the
lookup's gradient, a main_grad of another shape, CUDA-graph capture, anomaly mode) upstream's own
gradient is returned.

The writer belongs to megatron's fused path: it runs only where ``gradient_accumulation_fusion``
is on for the model (``fusion_on``), so that a fusion-off run is megatron's own. In the backward
it writes only where autograd accumulates into the weight (not where ``torch.autograd.grad``
captures its gradient) and where the hooks that hand the gradient on take the write: the state
it needs (the ids, the weight, its accumulator) travels in the graph, kept for a second backward
through a retained graph.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

from ..engine.callsite import Redirect, build_twin, check_live_is_source, find_assigned_calls, find_call_site
from ..engine.config import Config
from ..engine.target import DEFAULTS, Inspection, MethodTarget, PatchedTwin, Undo
from ..upstream import fsdp_rules
from ..upstream.fsdp_rules import is_fsdp_param, takes_direct_writes, wgrad_accumulates

LAYERS = "megatron.core.tensor_parallel.layers"
# 0.19+ look the weight up through a local name (GTP may stand a gathered copy in for it).
CALLS = ("F.embedding(masked_input, self.weight)", "F.embedding(masked_input, weight)")
NAME = "fsdp-embedding-wgrad"


def writes_into_main_grad(weight: Any) -> bool:
    """Whether the lookup of ``weight`` goes straight into its main_grad: a Megatron-FSDP
    parameter (``_gbuf``, ``get_main_grad``) whose gradient the twin's hooks hand on, while the
    target is installed."""
    attrs = getattr(weight, "__dict__", {})
    return (NAME in fsdp_rules.LOOKUP_WRITERS and is_fsdp_param(weight) and attrs.get("_gbuf") is not None
            and callable(attrs.get("get_main_grad")) and takes_direct_writes(weight)
            and weight.requires_grad and weight.dim() == 2 and not fsdp_rules.has_tensor_hooks(weight))


_function = None


def _lookup() -> Any:
    global _function
    if _function is None:
        import torch

        class LookupIntoMainGrad(torch.autograd.Function):
            """``F.embedding`` forward; backward adds the rows into ``main_grad`` (``write_rows``).
            What the backward needs travels in the graph (``ctx``): the ids, the weight and its
            gradient accumulator, kept for a second backward through a retained graph."""

            @staticmethod
            def forward(ctx: Any, ids: Any, weight: Any, accumulator: Any) -> Any:
                ctx.save_for_backward(ids)
                ctx.weight, ctx.accumulator = weight, accumulator
                return torch.nn.functional.embedding(ids, weight)

            @staticmethod
            def backward(ctx: Any, grad_output: Any) -> tuple[None, Any, None]:
                (ids,) = ctx.saved_tensors
                return None, write_rows(ctx.weight, ids, grad_output, ctx.accumulator), None

        _function = LookupIntoMainGrad
    return _function


def fsdp_embedding(ids: Any, weight: Any, *, layer: Any = None) -> Any:
    """Stands in for megatron's ``F.embedding(masked_input, weight)`` of ``layer`` (its
    ``VocabParallelEmbedding``): the writer only where megatron's gradient-accumulation fusion is
    on for the model, so that fusion off runs megatron's own lookup."""
    import torch

    if torch.is_grad_enabled() and writes_into_main_grad(weight) and fsdp_rules.fusion_on(layer, weight):
        accumulator = fsdp_rules.accumulator(weight)
        if accumulator is not None:
            return _lookup().apply(ids, weight, accumulator)
    # Megatron's own call, looked up as the original would: its module's F, now.
    return vars(sys.modules[LAYERS])["F"].embedding(ids, weight)


def write_rows(param: Any, ids: Any, grad_output: Any, accumulator: Any = None) -> Any:
    """The lookup's gradient added into ``param``'s main_grad; returns what autograd gets for the
    weight: a broadcast zero, None where a fused writer of this backward returned one already,
    or upstream's dense gradient where main_grad is not where it goes.

    Upstream's dense gradient, main_grad untouched: where this backward does not accumulate into
    the weight (``torch.autograd.grad`` captures its gradient, or ``inputs=`` leaves it out), or
    main_grad cannot take the rows, or the hooks that will hand the gradient on are megatron's
    own again (``revert()``, or fsdp-shared-grad switched off, since the forward). megatron's
    ``_grad_acc`` adds ``param.grad`` into main_grad, except where ``grad_added_to_main_grad``
    says a fused write of this backward is in already: then it drops ``param.grad``, and the
    rows go into main_grad as under the twin, so that the lookup is not dropped with it."""
    import torch

    if not fsdp_rules.accumulates(accumulator) or not (
            takes_direct_writes(param) or param.__dict__.get("grad_added_to_main_grad")):
        return dense_gradient(param, ids, grad_output)
    main_grad = param.get_main_grad()
    if (main_grad is None or main_grad.dtype != torch.float32 or tuple(main_grad.shape) != tuple(param.shape)
            or fsdp_rules.view_forbidden(main_grad) or fsdp_rules.has_tensor_hooks(param)):
        return dense_gradient(param, ids, grad_output)
    param.main_grad = main_grad
    rows = grad_output.reshape(-1, grad_output.shape[-1]).to(torch.float32)
    if not wgrad_accumulates(param):  # a fresh bucket with nothing of this backward in it yet
        main_grad.zero_()
    main_grad.index_add_(0, ids.reshape(-1), rows)
    param.grad_added_to_main_grad = True
    fsdp_rules.LOOKUP_WRITTEN.set(param, fsdp_rules.current_backward())
    fsdp_rules.ensure_only_zeros_prehook(param, accumulator)
    if fsdp_rules.zero_dummy_delivered(param):
        return None  # autograd accumulates the weight's gradient, and runs the hook, for that one
    zeros = torch.zeros((), dtype=grad_output.dtype, device=param.device).expand(param.shape)
    fsdp_rules.register_zero_dummy(param, zeros)
    return zeros


def dense_gradient(param: Any, ids: Any, grad_output: Any) -> Any:
    """What megatron's ``F.embedding`` hands autograd for the weight: the dense lookup gradient."""
    import torch

    return torch.ops.aten.embedding_dense_backward(grad_output, ids, param.shape[0], -1, False)


@dataclass(frozen=True, kw_only=True, eq=False)
class LookupTarget(MethodTarget):
    """Send the one ``output_parallel = F.embedding(...)`` of ``owner.attribute`` (either form of
    ``CALLS``) to ``fsdp_embedding`` in a twin of the method compiled from its own source."""

    def inspect(self, module: types.ModuleType, cfg: Config = DEFAULTS) -> Inspection:
        found = find_call_site(module, self.owner, self.attribute, CALLS[0])
        matches = [m for call in CALLS for m in find_assigned_calls(found.funcdef, call)]
        if len(matches) != 1:
            return Inspection(found.fingerprint, False, f"{len(matches)} `output_parallel = {CALLS[0]}` (or "
                                                        f"`{CALLS[1]}`) in {self.where}")
        check_live_is_source(module, self.owner, self.attribute)
        found.matches[:] = matches
        return Inspection(found.fingerprint, True, self.where, found)

    def install(self, module: types.ModuleType, found: Inspection, undo: Undo, cfg: Config) -> str | None:
        twin = build_twin(found.payload, self.where, [Redirect(found.payload.matches, "_gemm_patch_lookup",
                                                               fsdp_embedding, {"layer": "self"})])
        self.replace(module, undo, PatchedTwin(self.live_object(module), twin))
        undo.set_item(fsdp_rules.LOOKUP_WRITERS, self.name, True)
        return None


TARGET = LookupTarget(
    name=NAME,
    distribution="megatron-core",
    module=LAYERS,
    switch="GEMM_PATCH_EMBEDDING_WGRAD",
    relies_on="forward",
    owner="VocabParallelEmbedding",
    attribute="forward",
)
