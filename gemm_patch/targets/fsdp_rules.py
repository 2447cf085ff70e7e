"""Megatron-FSDP's parameter contract, as the targets read it: one place for the rules that
decide whether a fused weight gradient is added to ``main_grad`` or written over it, and when
a dummy ``grad_weight`` may alias ``main_grad``.

Every attribute is read from the instance ``__dict__``: a tensor's ``getattr`` of a missing name
raises internally, which costs about a microsecond per call on these hot paths.
"""

from __future__ import annotations

from typing import Any

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


def wgrad_accumulates(param: Any) -> bool:
    """Add rather than overwrite: the buffer persists, or this backward already wrote the
    weight's main_grad once (megatron sets ``grad_added_to_main_grad`` after each fused write;
    a weight used twice in one backward, a tied output layer under MTP, is written twice)."""
    if param is None:
        return False
    return main_grad_is_persistent(param) or bool(getattr(param, "__dict__", {}).get("grad_added_to_main_grad"))


def view_forbidden(tensor: Any) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``tensor``'s device, or
    autograd's anomaly mode is on (it checks returned gradients for NaN: the view shows
    main_grad's bits as bf16, and the low half of an fp32 number can read as NaN)."""
    import torch

    return (tensor.is_cuda and torch.cuda.is_current_stream_capturing()) or torch.is_anomaly_enabled()


def main_grad_alias(param: Any, shape: Any, dtype: Any) -> Any:
    """A ``dtype`` tensor of ``shape`` over the first bytes of ``param.main_grad``, or None.

    The dummy's values are never read: autograd stores it as ``param.grad`` (a stolen reference,
    no copy) and Megatron-FSDP's post-accumulate-grad hook (``_grad_acc``) deletes it at once
    because ``grad_added_to_main_grad`` is set. Only a write to ``param.grad`` could reach
    main_grad through the view, so it is given only where nothing writes there: a Megatron-FSDP
    parameter (``_gbuf``) that carries no mark of a second use, with no ``.grad`` pending from an
    earlier use, outside CUDA-graph capture (where megatron's own dummy keeps its fixed address),
    outside anomaly mode, over a contiguous main_grad on the same device that holds at least as
    many bytes."""
    attrs = getattr(param, "__dict__", {})
    main_grad = attrs.get("main_grad")
    if attrs.get("_gbuf") is None or main_grad is None or any(attrs.get(m) for m in SHARED_MARKS):
        return None
    import torch

    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if (param.grad is not None or not main_grad.is_contiguous() or main_grad.device != param.device
            or main_grad.numel() * main_grad.element_size() < nbytes or view_forbidden(main_grad)):
        return None
    return main_grad.view(-1).view(torch.uint8)[:nbytes].view(dtype).view(shape)
