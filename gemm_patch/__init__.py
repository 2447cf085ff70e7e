"""gemm_patch: lets megatron-core's fused weight-gradient path write fp32 main grads from
bf16/fp16 activations (Megatron-FSDP with gradient-accumulation fusion).

``import gemm_patch`` applies the patch unless ``GEMM_PATCH=0``; ``revert()`` undoes it.
Importing this package never imports torch, Transformer Engine or megatron.
"""

from __future__ import annotations

__version__ = "0.5.0"

from .engine import patcher as _patcher  # noqa: E402
from .engine.patcher import GemmPatchError, Status, apply, revert, status  # noqa: E402
from .targets import REGISTRY as _REGISTRY  # noqa: E402

_patcher.use_targets(_REGISTRY)
_patcher.use_version(__version__)

__all__ = ["GemmPatchError", "Status", "__version__", "apply", "revert", "status"]


def _imported_by_own_command() -> bool:
    """True while the ``gemm-patch`` command (or ``python -m gemm_patch``) imports the package.
    The command applies the patch itself where it wants it (status, doctor); ``run`` must not:
    the launcher process would report a bad variable that every child reports again, and
    raise in strict mode before starting anything."""
    import os
    import sys

    if sys.argv and os.path.splitext(os.path.basename(sys.argv[0]))[0] == "gemm-patch":
        return True
    argv = list(getattr(sys, "orig_argv", []))
    return "-m" in argv and argv[argv.index("-m") + 1:][:1] in (["gemm_patch"], ["gemm_patch.commands.cli"])


def _auto_apply() -> None:
    from .engine import config

    if config.enabled():  # GEMM_PATCH=0 beats every other variable, bad values included
        from .engine.patcher import apply_quietly

        apply_quietly()


def _start_grad_probe() -> None:
    """The read-only gradient probe of ``gemm-patch compare`` (GEMM_PATCH_GRAD_PROBE), also where
    GEMM_PATCH=0: it patches nothing."""
    import os

    if os.environ.get("GEMM_PATCH_GRAD_PROBE"):
        from .engine import grad_probe

        grad_probe.install()


if not _imported_by_own_command():
    _auto_apply()
    _start_grad_probe()
