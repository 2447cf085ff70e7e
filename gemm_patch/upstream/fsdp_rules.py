"""Megatron-FSDP's parameter contract, as the targets read it: one place for the rules that
decide whether a fused weight gradient is added to ``main_grad`` or written over it, and when
a dummy ``grad_weight`` may alias ``main_grad``.

Every attribute is read from the instance ``__dict__``: a tensor's ``getattr`` of a missing name
raises internally, which costs about a microsecond per call on these hot paths.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from ..engine.target import look_again

# Marks a weight megatron or Megatron-FSDP treats as used more than once: its .grad is added to
# or kept (zero_out_wgrad, the hook skipping _is_shared), so it must not alias main_grad.
SHARED_MARKS = ("_is_shared", "shared", "shared_embedding", "zero_out_wgrad")


def is_fsdp_param(obj: Any) -> bool:
    """A Megatron-FSDP parameter (megatron's layers test ``hasattr(weight, "__fsdp_param__")``)."""
    return "__fsdp_param__" in getattr(obj, "__dict__", ())


def main_grad_is_persistent(param: Any) -> bool:
    """Whether ``param.get_main_grad()`` returns Megatron-FSDP's persistent gradient buffer
    (the sum over the step's micro-batches: a wgrad must be added to it) rather than a bucket
    allocated for this backward and reduced before the next (not zeroed: it must be written).

    Megatron-FSDP (megatron-core 0.14-0.19, megatron-fsdp) sets ``param._gbuf``; its getter
    returns a view of the buffer's own storage exactly when ``not _gbuf.is_data_distributed``
    (``no_shard``/``optim``, or any strategy on one data-parallel rank). Without ``_gbuf`` it is
    not Megatron-FSDP's buffer: the overwrite of the replaced call stands.
    """
    gbuf = getattr(param, "__dict__", {}).get("_gbuf")
    return gbuf is not None and not getattr(gbuf, "is_data_distributed", True)


class ParamTable:
    """A value per live parameter object, held in this process's memory (weakly: an entry goes
    with its parameter), never in the parameter's ``__dict__``, which torch.save/pickle and
    ``copy.deepcopy`` would carry along: in another process graph-task ids restart at 0, and a
    record carried there would match that process's first backward."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[Any, Any]] = {}  # id(param) -> (weakref to it, value)

    def get(self, param: Any) -> Any:
        entry = self._items.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None

    def set(self, param: Any, value: Any) -> None:
        key = id(param)
        entry = self._items.get(key)
        ref = entry[0] if entry is not None and entry[0]() is param else weakref.ref(param, self._dropper(key))
        self._items[key] = (ref, value)

    def clear(self) -> list:
        """Every live parameter's value; the table emptied."""
        values = [value for ref, value in self._items.values() if ref() is not None and value is not None]
        self._items.clear()
        return values

    def pop(self, param: Any) -> Any:
        value = self.get(param)
        if value is not None:
            self._items.pop(id(param), None)
        return value

    def _dropper(self, key: int) -> Any:
        def drop(ref: Any) -> None:
            entry = self._items.get(key)
            if entry is not None and entry[0] is ref:
                self._items.pop(key, None)
        return drop


# Per parameter: the backward (autograd graph task) in which a fused write last went into its
# main_grad, until Megatron-FSDP's ``_grad_acc`` hands that gradient on (``restore_written_flag``).
WRITTEN = ParamTable()
# Parameters whose Megatron-FSDP hooks are fsdp-shared-grad's twin (``hooks_end_records``): only
# those hooks are known to hand a gradient on (``_grad_acc``, the bucket's reduce) after every
# use of the weight in the backward, so only there may a record decide that a write adds.
MANAGED = ParamTable()
# The MegatronFSDP instances whose hooks fsdp-shared-grad's twin registered (weakly held).
HOOKED: weakref.WeakSet = weakref.WeakSet()
# MANAGED's value for the parameters of megatron-core 0.14-0.15's hooks (a post-backward hook
# after each module call): only the post-accumulate-grad form (True) takes a lookup written
# straight into main_grad (fsdp-embedding-wgrad).
PER_MODULE_CALL = "per-module-call"
# Per parameter: (backward, weak reference to it) of the zero dummy a fused writer returned as its
# gradient in that backward (fsdp-wgrad for a zero_out_wgrad weight, fsdp-embedding-wgrad): the
# first one only; ``_only_zeros_prehook`` recognises it where it arrives alone.
ZERO_DUMMY = ParamTable()
# Per parameter: the backward in which exactly one of those zero dummies was all that reached its
# gradient (``_only_zeros_prehook``): its ``param.grad`` holds nothing to add.
ONLY_ZEROS = ParamTable()
# Per parameter: the backward in which fsdp-embedding-wgrad wrote the embedding lookup's gradient
# straight into its main_grad: its ``param.grad`` then holds only other uses' gradients (and zero
# dummies), which ``_grad_acc`` adds, as megatron's DDP does for a zero_out_wgrad weight.
LOOKUP_WRITTEN = ParamTable()
# Per parameter: the handle of ``_only_zeros_prehook`` on its gradient accumulator (AccumulateGrad).
ZERO_HOOKS = ParamTable()
# Per parameter: the configuration of the model whose MegatronFSDP hooks are the twin's (its root
# module's ``config``, as megatron's models keep it), for a layer that keeps none of its own.
MODEL_CONFIG = ParamTable()
# The key under which an accumulator's ``metadata`` holds its ``_only_zeros_prehook`` handle.
PREHOOK_KEY = "gemm_patch.only_zeros"


class _Installs(dict):
    """The installed targets that write a lookup straight into main_grad (name -> True); the
    last one's removal (an install's undo) takes every ``_only_zeros_prehook`` off."""

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        if not self:
            remove_zero_hooks()


LOOKUP_WRITERS = _Installs()
# Per parameter: the backward whose fused write, the latest, handed the weight's gradient back to
# its caller instead of accumulating it (``torch.autograd.grad``, ``inputs=`` without the weight):
# megatron's ``grad_added_to_main_grad`` stays set after it, with no ``_grad_acc`` to clear it.
HANDED_BACK = ParamTable()
# Parameters met by a fused write under hooks that are not the twin's (each reported once).
MET_UNMANAGED = ParamTable()
_graph_task = None  # torch._C._current_graph_task_id, bound on the first call (it imports torch)
log = logging.getLogger("gemm_patch")
_warned: set[str] = set()


def current_backward() -> int | None:
    """The id of the autograd graph task running now (one per ``backward()``; -1 outside one),
    or None on a torch without ``_current_graph_task_id``."""
    global _graph_task
    if _graph_task is None:
        import torch

        _graph_task = getattr(torch._C, "_current_graph_task_id", None) or (lambda: None)
    return _graph_task()


def written_in(param: Any, backward: int | None) -> bool:
    """Whether a fused write of the graph task ``backward`` is recorded for ``param``."""
    return backward is not None and backward >= 0 and WRITTEN.get(param) == backward


def hooks_end_records(fsdp: Any, root_module: Any, form: Any = True) -> None:
    """First statement of fsdp-shared-grad's ``_register_fsdp_hooks``: the MegatronFSDP
    ``fsdp`` runs the twin's hooks, and the parameters of ``root_module`` get hooks that end a
    record where the gradient is handed on. Without a module to read (nothing registered yet)
    no parameter is marked: its writes overwrite."""
    HOOKED.add(fsdp)
    parameters = getattr(root_module, "parameters", None)
    config = getattr(root_module, "config", None)
    for param in parameters() if callable(parameters) else ():
        MANAGED.set(param, form)
        if config is not None:
            MODEL_CONFIG.set(param, config)


def hooks_end_records_per_module_call(fsdp: Any, root_module: Any) -> None:
    """``hooks_end_records`` for megatron-core 0.14-0.15's twin (``PER_MODULE_CALL``)."""
    hooks_end_records(fsdp, root_module, PER_MODULE_CALL)


def takes_direct_writes(param: Any) -> bool:
    """Whether the twin's post-accumulate-grad ``_grad_acc`` hands on ``param``'s gradient (the
    0.16+ form of fsdp-shared-grad's hooks): only there may a gradient reach main_grad other than
    through a fused linear's write (fsdp-embedding-wgrad)."""
    return MANAGED.get(param) is True


def register_zero_dummy(param: Any, zeros: Any) -> bool:
    """Record ``zeros`` (a broadcast zero a fused writer returns as ``param``'s gradient) as the
    one ``zero_sum_hook`` may recognise in this backward; False where one is recorded already."""
    backward = current_backward()
    if backward is None or backward < 0:
        return False
    known = ZERO_DUMMY.get(param)
    if known is not None and known[0] == backward and known[1]() is not None:
        return False
    ZERO_DUMMY.set(param, (backward, weakref.ref(zeros)))
    return True


def zero_dummy_delivered(param: Any) -> bool:
    """Whether a fused writer of this backward already returned a recorded zero dummy for
    ``param``: autograd will accumulate its gradient (and run Megatron-FSDP's hook) anyway."""
    known = ZERO_DUMMY.get(param)
    return known is not None and known[0] == current_backward() and known[1]() is not None


def fusion_on(layer: Any, param: Any) -> bool:
    """Whether megatron's ``gradient_accumulation_fusion`` is on for ``layer``: its own
    configuration says so (megatron-core 0.18+ keep it on the embedding), else that of the model
    whose MegatronFSDP hooks (the twin's) handle ``param``; False where neither can be read."""
    config = getattr(layer, "__dict__", {}).get("config")
    if config is None:
        config = MODEL_CONFIG.get(param)
    return getattr(config, "gradient_accumulation_fusion", None) is True


def accumulator(param: Any) -> Any:
    """The autograd node that accumulates the leaf ``param``'s gradient into ``.grad``
    (AccumulateGrad: the one a graph recorded now leads to), or None (also where grad mode is
    off: no graph is recorded)."""
    try:  # torch.autograd.graph.get_gradient_edge (2.2+) does the same, slower
        return param.view_as(param).grad_fn.next_functions[0][0]
    except (AttributeError, IndexError, RuntimeError):
        return None


_current_node = None  # torch._C._current_autograd_node, bound on the first call


def accumulator_here(param: Any) -> Any:
    """Called in a backward: ``param``'s AccumulateGrad node, looked for first among the next
    nodes of the node running now (megatron's fused linear and the lookup writer take the weight
    as an input), which costs a fraction of making a view to reach it."""
    global _current_node
    if _current_node is None:
        import torch

        _current_node = getattr(torch._C, "_current_autograd_node", None) or (lambda: None)
    for next_node, _ in getattr(_current_node(), "next_functions", ()):
        if next_node is not None and getattr(next_node, "variable", None) is param:
            return next_node
    import torch

    with torch.enable_grad():  # a backward runs with grad mode off
        return accumulator(param)


def accumulates_into_grad(param: Any) -> bool:
    """Called in a backward: whether it accumulates ``param``'s gradient into ``.grad`` (and so
    through Megatron-FSDP's hook), rather than capturing it for ``torch.autograd.grad`` or
    leaving it out (``inputs=``). False where this torch cannot tell."""
    return accumulates(accumulator_here(param))


def hands_gradient_back(param: Any) -> bool:
    """Called in a backward: whether torch says it will not accumulate ``param``'s gradient into
    ``.grad`` (``torch.autograd.grad`` captures it, or ``inputs=`` leaves it out). False where
    it will, or where this torch cannot tell."""
    return runs_accumulator(accumulator_here(param)) is False


def accumulates(node: Any) -> bool:
    """Called in a backward: whether it runs ``node``, a leaf's AccumulateGrad, so that the
    gradient goes into ``.grad`` and through the parameter's hooks. False where the backward
    captures the leaf's gradient instead, leaves it out, or where this torch cannot tell."""
    return runs_accumulator(node) is True


def runs_accumulator(node: Any) -> bool | None:
    """Called in a backward: True where it runs ``node``, a leaf's AccumulateGrad; False where it
    captures the leaf's gradient instead (``torch.autograd.grad`` with the leaf among its inputs:
    torch refuses to answer for a captured leaf) or leaves it out (``inputs=``); None where this
    torch cannot tell."""
    import torch

    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if node is None or will_execute is None:
        return None
    try:
        return bool(will_execute(node))
    except RuntimeError:
        return False


def _only_zeros_prehook(param: Any) -> Any:
    ref = weakref.ref(param)

    def hook(grads: Any) -> Any:
        """What AccumulateGrad is about to store in ``param.grad``: where it is exactly the zero
        dummy a fused writer recorded (no other use contributed), say so, and hand it a view of
        main_grad's bytes instead (no full-size zeros to copy); the hooks that read
        ``param.grad`` then skip it (``ONLY_ZEROS``). A pre-hook of the node, not of the tensor:
        it runs only where autograd accumulates into the leaf, never on a gradient that
        ``torch.autograd.grad`` captures and returns. The view is given only where Megatron-FSDP's
        hook, run by the same node right after, deletes it unread: the twin's hooks handle the
        parameter now, a fused write of this backward is in main_grad, the parameter is not
        left to the root hook (``_is_shared``), and no hook of the user's will see it."""
        param = ref()
        grad = grads[0] if grads else None
        if param is None or grad is None:
            return None
        backward = current_backward()
        known = ZERO_DUMMY.get(param)
        attrs = param.__dict__
        if (known is None or known[0] != backward or known[1]() is not grad or param.grad is not None
                or not takes_direct_writes(param) or attrs.get("_is_shared") or has_tensor_hooks(param)
                or not (attrs.get("grad_added_to_main_grad") or written_in(param, backward))):
            return None
        view = storage_view(param, grad.shape, grad.dtype)
        if view is None:
            return None
        ONLY_ZEROS.set(param, backward)
        return (view,)

    return hook


def ensure_only_zeros_prehook(param: Any, node: Any) -> None:
    """``_only_zeros_prehook`` on ``param``'s accumulator ``node`` once, while a lookup writer
    is installed. A node lives as long as a graph (or anything) holds it: each new one gets it."""
    if not LOOKUP_WRITERS or node is None:
        return
    try:
        metadata = node.metadata
        handle = metadata.get(PREHOOK_KEY)
        hooks = handle.hooks_dict_ref() if handle is not None else None
        if hooks is not None and handle.id in hooks:
            return
        metadata[PREHOOK_KEY] = handle = node.register_prehook(_only_zeros_prehook(param))
    except (AttributeError, RuntimeError):  # a torch without node pre-hooks: autograd copies the dummy
        return
    ZERO_HOOKS.set(param, handle)


def remove_zero_hooks() -> None:
    """Every ``_only_zeros_prehook`` removed (the last lookup writer's undo)."""
    for handle in ZERO_HOOKS.clear():
        handle.remove()


def only_zeros(param: Any) -> bool:
    """Whether only a recorded zero dummy reached ``param``'s gradient in this backward."""
    backward = current_backward()
    return backward is not None and backward >= 0 and ONLY_ZEROS.get(param) == backward


def lookup_written(param: Any) -> bool:
    """Whether fsdp-embedding-wgrad wrote a lookup gradient into ``param``'s main_grad in this
    backward (its ``param.grad`` holds only other uses' gradients: to be added)."""
    backward = current_backward()
    return backward is not None and backward >= 0 and LOOKUP_WRITTEN.get(param) == backward


def _warn_unmanaged(param: Any) -> None:
    if "unmanaged" not in _warned:
        _warned.add("unmanaged")
        log.warning(
            "fsdp-wgrad: a Megatron-FSDP weight of shape %s was written twice in one backward into a "
            "fresh gradient bucket (sharded gradients), with megatron's grad_added_to_main_grad cleared in "
            "between, under Megatron-FSDP hooks that are not gemm-patch's (a MegatronFSDP built before "
            "gemm_patch.apply(), GEMM_PATCH_SHARED_GRAD=0, or Megatron-FSDP code fsdp-shared-grad does not "
            "know): the second write overwrites, as megatron's own call does, and one use's gradient may be "
            "lost; build the MegatronFSDP after apply() with fsdp-shared-grad on (docs/troubleshooting.md, "
            "known limits)", tuple(param.shape))


def wgrad_accumulates(param: Any) -> bool:
    """Add rather than overwrite; called once right before each fused write into
    ``param.main_grad``, which it records.

    Add where the buffer persists (the step's sum: always add), or where this backward has
    already put a gradient of the weight into its main_grad: a weight used twice in one backward
    (a tied output layer under MTP) is written twice, and the second write must keep the first.

    "Already written in this backward" is not ``grad_added_to_main_grad`` alone. Megatron sets
    that flag after each fused write, but Megatron-FSDP clears it on every unshard
    (``all_gather_and_wait_parameters_ready``), and with ``enable_fine_grained_param_gather_hook``
    every module unshards its weights again before its own backward: between the two uses of
    the weight, the flag reads False (megatron-core 0.16-0.19, sharded strategies: the second
    write overwrote the first). So each write is also recorded, with the id of the autograd
    graph task it ran in, and a later write in the same graph task adds. The record says "this
    backward's gradient of the weight is in its bucket, not yet handed on" only where something
    ends it when the gradient is handed on: fsdp-shared-grad's twin of the hooks, which ends it in
    ``_grad_acc`` and runs ``_grad_acc`` and the bucket's reduce once every use has reached
    autograd's accumulation (``without_pending_uses``). Under other hooks (upstream's, on an
    instance built before the patch; code the twin does not know) a bucket may be reduced, freed
    and fetched again, unzeroed, between two uses (0.14-0.15 run ``_grad_acc`` after each module
    call): there the record decides nothing, the write overwrites as megatron's own call does,
    and one WARNING says so. On sharded strategies each backward's bucket is allocated by
    ``fetch_bucket`` (``torch.empty``, not zeroed) and may share address or storage with the
    last one, so the first write of every backward must overwrite: a record of another graph
    task never matches. A write in a nested backward (reentrant activation checkpointing) has
    its own graph task and overwrites, as without the record. The flag still counts: where it is
    set, megatron says the write of this backward is in, as before, unless an earlier backward
    that handed the weight's gradient back (``torch.autograd.grad``) left it set
    (``flag_left_by_a_handed_back_write``). On a torch without the graph-task id only the flag
    counts."""
    if param is None:
        return False
    attrs = getattr(param, "__dict__", {})
    if attrs.get("_gbuf") is None and isinstance(attrs.get("overwrite_main_grad"), bool):
        # Not v1's buffer: Megatron-FSDP v2 (``fully_shard``) marks each parameter with Transformer
        # Engine's own flag, ``overwrite_main_grad``, which says it: False adds, True writes over.
        return not attrs["overwrite_main_grad"]
    if attrs.get("_gbuf") is not None and MANAGED.get(param) is None and MET_UNMANAGED.get(param) is None:
        # Megatron-FSDP hooks that are not the twin's: a MegatronFSDP built before apply()?
        MET_UNMANAGED.set(param, True)
        look_again()
    backward = current_backward()
    written = written_in(param, backward)
    if backward is not None:
        WRITTEN.set(param, backward)
    if main_grad_is_persistent(param):
        return True
    flag = attrs.get("grad_added_to_main_grad") and not flag_left_by_a_handed_back_write(param, backward)
    if backward is not None and backward >= 0:
        if hands_gradient_back(param):
            HANDED_BACK.set(param, backward)
        else:
            HANDED_BACK.pop(param)
    if flag:
        return True
    if written and MANAGED.get(param) is None:
        _warn_unmanaged(param)
        return False
    return written


def flag_left_by_a_handed_back_write(param: Any, backward: int | None) -> bool:
    """Whether ``grad_added_to_main_grad`` was set by a fused write of an earlier backward that
    handed the weight's gradient back (``torch.autograd.grad``, ``inputs=`` without it): no
    ``_grad_acc`` ran after it to clear the flag, so it says nothing of this backward, and a
    fresh bucket (unzeroed) must be written over, not added to."""
    handed_back = HANDED_BACK.get(param)
    return handed_back is not None and handed_back != backward


def restore_written_flag(param: Any) -> None:
    """First statement of Megatron-FSDP's ``_grad_acc`` (the fsdp-shared-grad twin): where a
    fused write of this backward went into ``main_grad`` but an unshard has cleared
    ``grad_added_to_main_grad`` since, set it again, and end the record.

    ``_grad_acc`` reads the flag to tell "main_grad holds the fused wgrad, ``param.grad`` is
    megatron's dummy (plus, on a tied weight, the other uses' gradient)" from "no fused write,
    ``param.grad`` is the whole gradient". Read as False after a fused write, it copies
    ``param.grad`` over the fresh bucket (sharded) or adds it into the persistent buffer: the
    fused gradient is lost or the dummy's memory is added. With the flag set, the fused gradient
    stays and ``add_shared_grad`` adds a ``zero_out_wgrad`` weight's ``param.grad``, as upstream
    does when no unshard intervened. Only a record of the graph task running now counts (the
    post-accumulate-grad hooks and the root post-backward callback run in it); a record left by
    a backward that never reached ``_grad_acc`` is dropped."""
    written = WRITTEN.pop(param)
    attrs = getattr(param, "__dict__", {})
    if written is not None and written == current_backward() and not attrs.get("grad_added_to_main_grad"):
        param.grad_added_to_main_grad = True


def without_pending_uses(params: list) -> list:
    """Inserted in megatron-core 0.14-0.15's ``_post_backward`` (the per-module-call post-backward
    hook; megatron-fsdp 0.1-0.2), after its ``_is_shared`` filter: the parameters whose gradient
    can be handed on now (``_grad_acc``, then the reduce of their bucket), without those that
    a fused write of this backward has written but whose ``.grad`` autograd has not accumulated
    yet.

    Those releases run the hook after each call of a module, so a weight used twice per backward
    (the output layer under multi-token prediction) would reach ``_grad_acc`` and the reduce after
    its first use's backward: sharing its bucket with other parameters, the bucket stays
    unreduced and the second fused write, its flag cleared by ``_grad_acc``, would overwrite the
    first (0.74-0.98 relative error on the CPU); in a bucket of its own, reduced after the
    first use, the second write would find a reduced bucket, or a freshly fetched unzeroed one.
    Autograd accumulates a weight's ``.grad`` (megatron's dummy after a fused write) once all its
    uses have delivered theirs, and ahead of
    the module's hook, so a fused-written weight whose ``.grad`` is still None has a use to come.
    It is left to a later call of the hook (its last use), or to the root post-backward hook,
    which handles every parameter no module hook took: as 0.16+ and ``_is_shared`` weights do,
    ``_grad_acc`` and the reduce run once, after every use."""
    backward = current_backward()
    return [p for p in params
            if p.grad is not None or not (getattr(p, "__dict__", {}).get("grad_added_to_main_grad")
                                         or written_in(p, backward))]


def view_forbidden(tensor: Any) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``tensor``'s device, or
    autograd's anomaly mode is on (it checks returned gradients for NaN: the view shows
    main_grad's bits as bf16, and the low half of an fp32 number can read as NaN)."""
    import torch

    return (tensor.is_cuda and torch.cuda.is_current_stream_capturing()) or torch.is_anomaly_enabled()


def has_tensor_hooks(param: Any) -> bool:
    """Whether a hook other than Megatron-FSDP's own will be handed the gradient autograd
    accumulates for ``param`` (megatron's dummy, after a fused write), which it may change in
    place: one registered with ``param.register_hook``, or a post-accumulate-grad hook (it reads
    ``param.grad``) not defined in megatron's code (Megatron-FSDP's ``_grad_acc`` deletes the
    dummy unread). What such a hook writes must reach only what it reaches upstream, never
    main_grad."""
    if getattr(param, "_backward_hooks", None):
        return True
    post = getattr(param, "_post_accumulate_grad_hooks", None)
    return bool(post) and not all(
        getattr(getattr(hook, "func", hook), "__module__", "").startswith("megatron") for hook in post.values())


def storage_view(param: Any, shape: Any, dtype: Any) -> Any:
    """A ``dtype`` tensor of ``shape`` over the first bytes of ``param.main_grad`` (contiguous, on
    the parameter's device, large enough, outside capture and anomaly mode), or None. Only for a
    gradient nothing will read or write."""
    main_grad = getattr(param, "__dict__", {}).get("main_grad")
    if main_grad is None:
        return None
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if (not main_grad.is_contiguous() or main_grad.device != param.device
            or main_grad.numel() * main_grad.element_size() < nbytes or view_forbidden(main_grad)):
        return None
    import torch

    return main_grad.view(-1).view(torch.uint8)[:nbytes].view(dtype).view(shape)


def main_grad_alias(param: Any, shape: Any, dtype: Any) -> Any:
    """A ``dtype`` tensor of ``shape`` over the first bytes of ``param.main_grad``, or None.

    The dummy's values are never read: autograd stores it as ``param.grad`` (a stolen reference,
    no copy) and Megatron-FSDP's post-accumulate-grad hook (``_grad_acc``) deletes it at once
    because ``grad_added_to_main_grad`` is set. Only a write to ``param.grad`` could reach
    main_grad through the view, so it is given only where nothing writes there: a Megatron-FSDP
    parameter (``_gbuf``) that carries no mark of a second use, with no ``.grad`` pending from an
    earlier use, without tensor hooks (``has_tensor_hooks``), in a backward that accumulates into
    ``.grad`` (``torch.autograd.grad`` would hand the view itself to the caller, who may write
    into it), outside CUDA-graph capture (where megatron's own dummy keeps its fixed address),
    outside anomaly mode, over a contiguous main_grad on the same device that holds at least as
    many bytes."""
    attrs = getattr(param, "__dict__", {})
    if (attrs.get("_gbuf") is None or attrs.get("main_grad") is None or any(attrs.get(m) for m in SHARED_MARKS)
            or has_tensor_hooks(param) or param.grad is not None or not accumulates_into_grad(param)):
        return None
    return storage_view(param, shape, dtype)
