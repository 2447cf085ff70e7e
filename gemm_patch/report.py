"""What gemm_patch says: the Status object (``status()``, ``gemm-patch status``), and the log
lines, every one of them carrying the ``[gemm_patch] LEVEL:`` prefix.

Once per process, when a target module is patched, one summary line (rank 0 at INFO or, when a
target is left alone or skipped, at WARNING; other ranks at DEBUG), and at most one more for
targets first seen later (Megatron-FSDP's module is imported with ``megatron.core.distributed``,
before or after the layers module, or not at all). Later events log at DEBUG.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from . import detection
from .targets.apex_wgrad import APEX_WORDS
from .targets.base import APEX_REAL, NOT_APPLICABLE, OFF, PATCHED_STATES, SKIPPED, UNVERIFIED, TargetStatus

log = logging.getLogger("gemm_patch")
PREFIX = "[gemm_patch] %(levelname)s: %(message)s"


def configure_logging(level: str = "INFO") -> None:
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(PREFIX))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(level)


def emit(level: int, message: str) -> None:
    """Log ``message``; where logging is disabled for that level (``logging.disable``), write
    the same prefixed line to stderr: an error that leaves the process unpatched is never lost."""
    configure_logging(logging.getLevelName(log.level) if log.level else "INFO")
    if log.isEnabledFor(level) and logging.root.manager.disable < level:
        log.log(level, message)
        return
    if level >= logging.ERROR:
        try:
            sys.stderr.write(f"[gemm_patch] {logging.getLevelName(level)}: {message}\n")
        except Exception:
            pass


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
    apex: str = "unknown"  # a key of APEX_WORDS
    disabled: str | None = None  # why nothing is applied (GEMM_PATCH=0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "gemm_patch": self.version,
            "applied": self.applied,
            "strict": self.strict,
            "backend": self.backend,
            "config_error": self.config_error,
            "disabled": self.disabled,
            "versions": self.versions,
            "targets": [t.as_dict() for t in self.targets],
            "backends": self.backends,
            "apex": self.apex,
        }

    def __str__(self) -> str:
        lines = [f"gemm_patch {self.version}: {'applied' if self.applied else 'not applied'}"
                 f"{' (strict)' if self.strict else ''}"]
        if self.disabled:
            lines.append(f"  disabled: {self.disabled}")
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


def _part(st: TargetStatus) -> str:
    if st.name == "apex-wgrad":
        if st.state in PATCHED_STATES:
            return f"{st.name} provided (apex missing; {st.state})"
        if st.state == APEX_REAL:
            return f"{st.name} idle (apex real)"
    if st.state in (UNVERIFIED, SKIPPED):
        return f"{st.name} {st.state}: {st.reason}"
    if st.state == OFF:
        return f"{st.name} off ({st.reason})"
    return f"{st.name} {st.state}"


class SummaryLog:
    """The once-per-process summary line and its one follow-up (see the module docstring)."""

    def __init__(self) -> None:
        self.lines = 0
        self.seen: set[str] = set()

    def record(self, component: str, version: str | None, done: list[TargetStatus], backends: str) -> None:
        new = [st for st in done if st.name not in self.seen]
        self.seen.update(st.name for st in done)
        if not new:
            return
        troubled = any(st.state in (UNVERIFIED, SKIPPED) for st in new)
        level = logging.WARNING if troubled else logging.INFO
        if detection.process_rank() != 0 or (self.lines >= 2 and not troubled):
            level = logging.DEBUG
        tail = f"; {backends}" if self.lines == 0 and backends else ""
        self.lines += 1
        # Targets for other releases' code (not applicable) are in status(), not in the line.
        shown = [st for st in new if st.state != NOT_APPLICABLE] or new
        emit(level, f"{component} {version}: {', '.join(_part(st) for st in shown)}{tail}")
