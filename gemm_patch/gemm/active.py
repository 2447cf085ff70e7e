"""The process-wide dispatcher every patched call site calls, and the GEMM_PATCH_BACKEND it
runs: handed over by the patcher at each ``apply()`` (``use_backend``), never read from the
environment here. Importing this module imports no torch; building the dispatcher does."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .dispatcher import WgradDispatcher

_backend = "auto"  # the setting handed over last
_active: WgradDispatcher | None = None


def use_backend(backend: str) -> None:
    """Run ``backend`` (a GEMM_PATCH_BACKEND value) from the next call on: a dispatcher built
    for another setting is dropped, and the next call builds one in this setting's order."""
    global _backend, _active
    _backend = backend
    if _active is not None and _active.forced != backend:
        _active = None


def active_dispatcher() -> WgradDispatcher:
    """The process-wide dispatcher, built on first use for the setting handed over last."""
    global _active
    if _active is None:
        from .dispatcher import WgradDispatcher

        _active = WgradDispatcher(_backend)
    return _active


def reset_active_dispatcher() -> None:
    global _active
    _active = None
