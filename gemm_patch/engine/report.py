"""What gemm_patch says: the Status object (``status()``, ``gemm-patch status``), and the log
lines, every one of them carrying the ``[gemm_patch] LEVEL:`` prefix.

One summary line per patched module, the first time it is patched in the process
(``SummaryLog``); later events log at DEBUG.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from . import detection
from .target import NOT_APPLICABLE, OFF, PATCHED_STATES, PENDING, STATE_MEANINGS, TROUBLED_STATES, TargetStatus

log = logging.getLogger("gemm_patch")
PREFIX = "[gemm_patch] %(levelname)s: %(message)s"


_own_level: int | None = None  # the level configure_logging gave the logger last (None: none yet)
_configure_lock = threading.Lock()  # two first emits in two threads must not add two handlers


def configure_logging(level: str | int | None = None) -> None:
    """Give the ``gemm_patch`` logger its prefixed stderr handler and a level, where the host
    has not configured that logger itself. Never raises: it runs inside the import it patches.

    Handler: added (with ``propagate`` off, so a root handler does not print each line twice)
    only while the logger has no handler; a handler the host attached, and its ``propagate``,
    are kept. Configuring only the root logger (``basicConfig``) is not a choice for this one.

    Level: the host's wins. A level that anyone but this function set on the ``gemm_patch``
    logger, before or after ``import gemm_patch``, named or not (``logging.CRITICAL + 1``, 15),
    is kept. One exception: an explicit ``GEMM_PATCH_LOG_LEVEL`` (``apply()`` passes it as
    ``level``), which whoever starts the job set for this very logger (``DEBUG`` to see every
    rank's summary); it beats a level the host set before ``apply()``, and the host can still
    set another one after. Otherwise ``level`` is set only while the logger's level is NOTSET or
    still the one set here last; with no ``level`` (``emit``), INFO only while it is NOTSET.
    Levels stay numbers: none is derived from its name (``logging.getLevelName(51)`` is
    ``'Level 51'``, which ``setLevel`` refuses)."""
    global _own_level
    number = level if isinstance(level, int) else logging.getLevelName(str(level or "INFO").strip().upper())
    if not isinstance(number, int):
        number = logging.INFO  # unreachable through config.load(), which accepts names only
    # Read here rather than passed in: Config.log_level is INFO both unset and set to INFO.
    explicit = level is not None and bool(os.environ.get("GEMM_PATCH_LOG_LEVEL", "").strip())
    with _configure_lock:
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(PREFIX))
            log.addHandler(handler)
            log.propagate = False
        if explicit or log.level == logging.NOTSET or (level is not None and log.level == _own_level):
            log.setLevel(number)
            _own_level = number


def emit(level: int, message: str) -> None:
    """Log ``message``; where logging is disabled for that level (``logging.disable``), write
    the same prefixed line to stderr: an error that leaves the process unpatched is never lost."""
    try:
        configure_logging()  # a handler if none yet; a level the host set stays as it is
    except Exception:
        pass  # a broken logging setup of the host's: still try the line below
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
    fields: dict[str, tuple[str, str]] = field(default_factory=dict)  # a target's own: name -> (word, meaning)
    disabled: str | None = None  # why nothing is applied (GEMM_PATCH=0)
    distributions: dict[str, str] = field(default_factory=dict)  # target -> whose version keys it
    meanings: dict[str, str] = field(default_factory=dict)  # targets' own states -> meaning
    data_error: str | None = None  # what is wrong with gemm_patch's releases.json (nothing applied)

    def __getattr__(self, name: str) -> str:
        # A target's field reads as an attribute (``status().apex``), as in the JSON.
        fields = self.__dict__.get("fields") or {}
        if name in fields:
            return fields[name][0]
        raise AttributeError(name)

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "gemm_patch": self.version,
            "applied": self.applied,
            "strict": self.strict,
            "backend": self.backend,
            "config_error": self.config_error,
            "data_error": self.data_error,
            "disabled": self.disabled,
            "versions": self.versions,
            "targets": [t.as_dict() for t in self.targets],
            "backends": self.backends,
            **{name: word for name, (word, _) in self.fields.items()},
        }

    def applies(self, st: TargetStatus) -> bool:
        """Whether a target concerns what is installed: shown by default, the rest counted."""
        if st.state == NOT_APPLICABLE:
            return False
        if st.state in (OFF, PENDING):
            return self.versions.get(self.distributions.get(st.name, ""), None) is not None
        return True

    def __str__(self) -> str:
        return self.render()

    def render(self, all_targets: bool = False, error_below: bool = False) -> str:
        """The text of ``gemm-patch status``: the targets that concern what is installed (every
        one with ``all_targets``), what each state shown means, apex, the backends.
        ``error_below``: a configuration error is printed in full after this text (the
        command's last line, on stderr), so here it is only named."""
        lines = [f"gemm_patch {self.version}: {'applied' if self.applied else 'not applied'}"
                 f"{' (strict)' if self.strict else ''}"]
        if self.disabled:
            lines.append(f"  disabled: {self.disabled}")
        if self.data_error:
            lines.append(f"  release data damaged: {self.data_error}")
        if self.config_error and error_below:
            variable = self.config_error.split("=", 1)[0]
            lines.append(f"  configuration error: {variable} holds a value gemm_patch does not accept "
                         f"(the last line says which, and what is accepted)")
        elif self.config_error:
            lines.append(f"  configuration error: {self.config_error}")
        installed = ", ".join(f"{k} {v}" for k, v in self.versions.items() if v is not None)
        lines.append(f"  installed: {installed or 'none of megatron-core, TE, torch, NeMo'}")
        shown = [t for t in self.targets if all_targets or self.applies(t)]
        width = max([12, *(len(t.name) for t in shown)])
        for t in shown:
            lines.append(f"  {t.name:<{width}} {t.state:<15} {t.reason}")
        hidden = len(self.targets) - len(shown)
        if hidden:
            lines.append(f"  ({hidden} more target{'s' if hidden != 1 else ''} for code not installed here: "
                         f"not applicable; --all lists them)")
        meanings = {**STATE_MEANINGS, **self.meanings}
        states = list(dict.fromkeys(t.state for t in shown))
        if states:
            lines.append("  states: " + "; ".join(f"{s} = {meanings.get(s, s)}" for s in states))
        for name, (word, meaning) in self.fields.items():
            lines.append(f"  {name}: {word}: {meaning}")
        if self.config_error and not self.applied:
            lines.append("  backends: none configured (the configuration error above leaves gemm_patch unapplied)")
        elif self.backends:
            in_use = self.backends.get("in_use", {})
            used = "; ".join(f"{name} for {case}" for case, name in in_use.items())
            lines.append(f"  backends: {' > '.join(self.backends.get('order', []))}"
                         f" (GEMM_PATCH_BACKEND={self.backend}){'; in use: ' + used if used else ''}")
            for name, why in self.backends.get("unavailable", {}).items():
                lines.append(f"    {name}: unavailable: {why}")
            for item in self.backends.get("demoted", []):
                lines.append(f"    demoted: {item}")
        return "\n".join(lines)


class SummaryLog:
    """One line per patched module, the first time it is patched in this process.

    On rank 0 the line is INFO where a target of the module is patched, WARNING where one is
    left alone, skipped or replaced, and DEBUG where nothing in it is patched (off, not
    applicable: ``status()`` has those); other ranks (and an unknown rank) log it at DEBUG. No
    cap: each component's fixes are named where a user looks, whatever else (TE, an expert
    module, NeMo) was imported first; later patches of the same module (a re-import,
    ``apply()`` after ``revert()``) log at DEBUG. The first line carries the backend
    order."""

    def __init__(self) -> None:
        self.lines = 0
        self.seen: set[str] = set()

    def record(self, component: str, version: str | None, done: list[tuple[Any, TargetStatus]],
               backends: str) -> None:
        new = [(target, st) for target, st in done if st.name not in self.seen]
        self.seen.update(st.name for _, st in done)
        if not new:
            return
        troubled = any(st.state in TROUBLED_STATES for _, st in new)
        patched = any(st.state in PATCHED_STATES or st.state in target.extra_states for target, st in new)
        if detection.process_rank() != 0 or not (troubled or patched):
            level = logging.DEBUG
        else:
            level = logging.WARNING if troubled else logging.INFO
        tail = f"; {backends}" if self.lines == 0 and backends and level > logging.DEBUG else ""
        if level > logging.DEBUG:
            self.lines += 1
        # Targets for other releases' code (not applicable) are in status(), not in the line.
        shown = [(t, st) for t, st in new if st.state != NOT_APPLICABLE] or new
        release = f"{component} {version}" if version else f"{component} (version unknown)"
        emit(level, f"{release}: {', '.join(t.summary_part(st) for t, st in shown)}{tail}")
