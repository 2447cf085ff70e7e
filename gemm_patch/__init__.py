"""gemm_patch: lets megatron-core's fused weight-gradient path write fp32 main grads from
bf16/fp16 activations (Megatron-FSDP with gradient-accumulation fusion).

``import gemm_patch`` applies the patch unless ``GEMM_PATCH=0``; ``revert()`` undoes it.
Importing this package never imports torch, Transformer Engine or megatron.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .patcher import GemmPatchError, Status, apply, revert, status  # noqa: E402

__all__ = ["GemmPatchError", "Status", "__version__", "apply", "revert", "status"]


def _auto_apply() -> None:
    from . import config

    try:
        enabled = config.load().enabled
    except config.ConfigError:
        enabled = True  # apply() reports the bad value once (and raises only in strict mode)
    if enabled:
        apply()


_auto_apply()
