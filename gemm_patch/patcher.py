"""The one place that decides what gets patched, when, and how it is undone.

``apply()`` registers a wrapt post-import hook per target module; wrapt runs it at once if the
module is already imported, otherwise right after its import. ``revert()`` replays each
target's undo list. Both hold one lock, so they are idempotent and thread-safe; the hooks stay
registered (wrapt cannot remove them) but do nothing while the patch is reverted.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any

import wrapt

from . import config, detection
from .targets import (
    APEX_WGRAD,
    APEX_WORDS,
    NOT_APPLICABLE,
    OFF,
    PENDING,
    SKIPPED,
    TARGETS,
    UNVERIFIED,
    TargetStatus,
    Undo,
    UnverifiedRefused,
    apex_summary,
    apex_word,
)

log = logging.getLogger("gemm_patch")

_lock = threading.RLock()
_wanted = False
_hooked: set[str] = set()
_undo: dict[str, Undo] = {}
_states: dict[str, TargetStatus] = {}
_config_error: str | None = None
_summary_logged = False  # the once-per-process summary line
_late_logged = False  # the one extra line for targets whose module was imported after it
_logged_targets: set[str] = set()


class GemmPatchError(RuntimeError):
    """Raised only in strict mode (``GEMM_PATCH_STRICT=1`` or ``apply(strict=True)``)."""


@dataclass
class Status:
    version: str
    applied: bool
    strict: bool
    backend: str
    config_error: str | None
    versions: dict[str, str | None]
    targets: list[TargetStatus]
    backends: dict[str, Any] = field(default_factory=dict)
    apex: str = "unknown"  # a key of targets.APEX_WORDS

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "gemm_patch": self.version,
            "applied": self.applied,
            "strict": self.strict,
            "backend": self.backend,
            "config_error": self.config_error,
            "versions": self.versions,
            "targets": [t.as_dict() for t in self.targets],
            "backends": self.backends,
            "apex": self.apex,
        }

    def __str__(self) -> str:
        lines = [f"gemm_patch {self.version}: {'applied' if self.applied else 'not applied'}"
                 f"{' (strict)' if self.strict else ''}"]
        if self.config_error:
            lines.append(f"  configuration error: {self.config_error}")
        installed = ", ".join(f"{k} {v}" for k, v in self.versions.items() if v is not None)
        lines.append(f"  installed: {installed or 'none of megatron-core, TE, torch, NeMo'}")
        width = max([12, *(len(t.name) for t in self.targets)])
        for t in self.targets:
            lines.append(f"  {t.name:<{width}} {t.state:<15} {t.reason}")
        lines.append(f"  apex: {self.apex}: {APEX_WORDS.get(self.apex, '')}")
        if self.backends:
            lines.append(f"  backends: {' > '.join(self.backends.get('order', []))}"
                         f" (GEMM_PATCH_BACKEND={self.backend})")
            for name, why in self.backends.get("unavailable", {}).items():
                lines.append(f"    {name}: unavailable: {why}")
            for item in self.backends.get("demoted", []):
                lines.append(f"    demoted: {item}")
        return "\n".join(lines)


def _read_config(strict: bool | None) -> config.Config | None:
    global _config_error
    try:
        cfg = config.load()
        _config_error = None
    except config.ConfigError as exc:
        _config_error = str(exc)
        if strict or (strict is None and config.strict_requested()):
            raise GemmPatchError(f"gemm_patch: {exc}") from None
        log.error("gemm_patch not applied: %s", exc)
        return None
    if strict is not None:
        cfg = config.Config(**{**cfg.__dict__, "strict": strict})
    return cfg


def configure_logging(level: str) -> None:
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[gemm_patch] %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(level)


def apply(strict: bool | None = None) -> Status:
    """Patch every target now or, for modules not yet imported, right after their import.

    ``strict`` overrides ``GEMM_PATCH_STRICT``. Calling it again is a no-op."""
    global _wanted, _strict
    with _lock:
        cfg = _read_config(strict)
        if cfg is None:
            return status()
        configure_logging(cfg.log_level)
        _wanted, _strict = True, cfg.strict
        for target in TARGETS:
            if target.name in _undo:
                continue
            _states[target.name] = TargetStatus(target.name, target.module, PENDING,
                                                f"waiting for `import {target.module}`")
            if target.module not in _hooked:
                _hooked.add(target.module)
                wrapt.register_post_import_hook(_on_import, target.module)
            elif target.module in sys.modules:
                _on_import(sys.modules[target.module])
        return status()


_strict = False


def revert() -> Status:
    """Restore every patched object to the exact original; a no-op when nothing is applied."""
    global _wanted
    with _lock:
        _wanted = False
        for name in list(_undo):
            _undo.pop(name).run()
        for name, st in _states.items():
            _states[name] = TargetStatus(name, st.module, OFF, "reverted by gemm_patch.revert()",
                                         st.version, st.fingerprint)
        return status()


def _on_import(module: types.ModuleType) -> None:
    with _lock:
        if not _wanted:
            return
        version = _distribution_version(module)
        done = []
        for target in TARGETS:
            if target.module != module.__name__ or target.name in _undo:
                continue
            try:
                st, undo = target.patch(module, version, _strict)
            except UnverifiedRefused as exc:
                raise GemmPatchError(str(exc)) from None
            except Exception as exc:  # a fault in the patcher must not break the import
                if _strict:
                    raise
                st, undo = TargetStatus(target.name, target.module, SKIPPED,
                                        f"internal error while patching: {type(exc).__name__}: {exc}",
                                        version), Undo()
            if st.state == SKIPPED and _strict:
                raise GemmPatchError(f"{target.name}: {st.reason} (GEMM_PATCH_STRICT=1)")
            if undo.steps:
                _undo[target.name] = undo
            _states[target.name] = st
            done.append(st)
        if done:
            _log_summary(done)


# Top-level package of a target module -> the component whose version keys its fingerprints.
_COMPONENTS = {"megatron": "megatron-core", "megatron_fsdp": "megatron-fsdp"}


def _distribution_version(module: types.ModuleType) -> str | None:
    component = _COMPONENTS.get(module.__name__.split(".")[0])
    return detection.distribution_version(component) if component else None


def _log_summary(done: list[TargetStatus]) -> None:
    """One line per process (rank 0 at INFO, other ranks at DEBUG) for the targets patched
    first, and at most one more for targets first seen later (Megatron-FSDP's module is imported
    by ``megatron.core.distributed``, before or after the layers module, or not at all; any
    further ones at DEBUG); a re-apply after revert() logs nothing new."""
    global _summary_logged, _late_logged
    level = logging.INFO if detection.process_rank() == 0 else logging.DEBUG
    for st in done:
        if st.state == UNVERIFIED:
            log.warning("%s patched but unverified: %s", st.name, st.reason)
    new = [st for st in done if st.name not in _logged_targets]
    _logged_targets.update(st.name for st in done)
    if _summary_logged and not new:
        return
    parts = ", ".join(apex_summary(st) if st.name == APEX_WGRAD.name else f"{st.name} {st.state}"
                      for st in (new if _summary_logged else done))
    component = _COMPONENTS.get(done[0].module.split(".")[0], "megatron-core")
    if not _summary_logged:
        _summary_logged = True
        log.log(level, "%s %s: %s; %s", component, done[0].version, parts, _backend_summary())
    else:
        level = logging.DEBUG if _late_logged else level
        _late_logged = True
        log.log(level, "%s %s: %s", component, done[0].version, parts)


def _backend_summary() -> str:
    from .dispatcher import active_dispatcher

    return "backends " + ">".join(active_dispatcher().order)


def _resolve_pending(target: Any, st: TargetStatus | None) -> TargetStatus | None:
    """A pending target whose module cannot exist in what is installed (its package is imported
    but has no such module: megatron-core 0.13.1 has no Megatron-FSDP) reads as not applicable;
    its hook stays registered, so a module that turns up later is still patched."""
    if st is None or st.state != PENDING or detection.module_findable(target.module) is not False:
        return st
    version = detection.distribution_version(target.distribution)
    reason = (f"{target.distribution} {version} has no module {target.module}" if version
              else f"{target.distribution} is not installed (no {target.module.split('.')[0]} package)")
    return TargetStatus(st.name, st.module, NOT_APPLICABLE, reason, version)


def status() -> Status:
    """A structured snapshot: versions, each target's state and reason, the backend order."""
    from . import __version__

    with _lock:
        try:
            cfg = config.load()
        except config.ConfigError:
            cfg = config.Config()
        targets = [
            _resolve_pending(t, _states.get(t.name))
            or TargetStatus(t.name, t.module, OFF, "gemm_patch.apply() not called")
            for t in TARGETS
        ]
        backends: dict[str, Any] = {}
        if "torch" in sys.modules:  # never pull torch in just to describe backends
            from .dispatcher import active_dispatcher

            backends = active_dispatcher().describe()
        return Status(__version__, _wanted, _strict, cfg.backend, _config_error,
                      detection.installed_versions(), targets, backends,
                      apex_word(_states.get(APEX_WGRAD.name), cfg.apex_shim))


def import_target_modules() -> None:
    """Import every installed target module, so that status() reports what the patch did to
    them rather than that it is waiting for them (``gemm-patch status`` and ``doctor``)."""
    import importlib

    for module in sorted({t.module for t in TARGETS}):
        try:
            importlib.import_module(module)
        except ImportError:
            pass
