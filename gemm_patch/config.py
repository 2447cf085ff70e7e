"""Environment-variable configuration: parsed once, validated with messages that name the fix.

Every variable is read here and nowhere else, so the order of precedence lives in one place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
BACKEND_CHOICES = ("auto", "te", "native", "fallback")
LOG_LEVEL_CHOICES = ("DEBUG", "INFO", "WARNING", "ERROR")


class ConfigError(ValueError):
    """An environment variable holds a value gemm_patch does not accept."""


@dataclass(frozen=True)
class Config:
    enabled: bool = True
    strict: bool = False
    backend: str = "auto"
    log_level: str = "INFO"
    allow_unverified: bool = False
    switches: Mapping[str, bool] = field(default_factory=dict)  # a target's variable -> on
    left_out: frozenset[str] = frozenset()  # GEMM_PATCH_DISABLE: target names

    def switch_on(self, variable: str, default: bool = True) -> bool:
        return self.switches.get(variable, default)


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(
        f"{name}={raw!r} is not accepted; use one of {', '.join(_TRUE + _FALSE)} "
        f"(unset means {'1' if default else '0'})"
    )


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str,
            normalise=str.lower) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = normalise(raw.strip())
    if value not in choices:
        raise ConfigError(
            f"{name}={raw!r} is not accepted; use one of {', '.join(choices)} (unset means {default})"
        )
    return value


def _names(env: Mapping[str, str], name: str, known: tuple[str, ...]) -> frozenset[str]:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return frozenset()
    names = [part.strip() for part in raw.split(",") if part.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(
            f"{name}={raw!r} names no target {', '.join(repr(n) for n in unknown)}; use target names "
            f"separated by commas, of: {', '.join(known)} (unset means none)"
        )
    return frozenset(names)


def strict_requested(env: Mapping[str, str] | None = None) -> bool:
    """Strict mode, read on its own so a bad value elsewhere can still be judged strictly."""
    env = os.environ if env is None else env
    try:
        return _flag(env, "GEMM_PATCH_STRICT", False)
    except ConfigError:
        return False


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """``GEMM_PATCH`` alone: ``0`` beats every other variable, whatever their values."""
    env = os.environ if env is None else env
    try:
        return _flag(env, "GEMM_PATCH", True)
    except ConfigError:
        return True  # load() reports the bad value


def load(env: Mapping[str, str] | None = None,
         switches: tuple[str, ...] | Mapping[str, bool] = (), targets: tuple[str, ...] = ()) -> Config:
    """Read every GEMM_PATCH_* variable, each target switch in ``switches`` (names, or name ->
    default for opt-in targets) and ``GEMM_PATCH_DISABLE`` (a subset of ``targets``, the known
    target names); raise ConfigError naming the first bad one. With ``GEMM_PATCH=0`` nothing else
    is read."""
    env = os.environ if env is None else env
    if not _flag(env, "GEMM_PATCH", True):
        return Config(enabled=False)
    _flag(env, "GEMM_PATCH_AUTO", False)  # read by the start-up hook; validated here for one message
    return Config(
        enabled=True,
        strict=_flag(env, "GEMM_PATCH_STRICT", False),
        backend=_choice(env, "GEMM_PATCH_BACKEND", BACKEND_CHOICES, "auto"),
        log_level=_choice(env, "GEMM_PATCH_LOG_LEVEL", LOG_LEVEL_CHOICES, "INFO", str.upper),
        allow_unverified=_flag(env, "GEMM_PATCH_ALLOW_UNVERIFIED", False),
        switches={name: _flag(env, name, default) for name, default in
                  (switches.items() if isinstance(switches, Mapping) else dict.fromkeys(switches, True).items())},
        left_out=_names(env, "GEMM_PATCH_DISABLE", targets),
    )


# The configuration the patcher applied last (None: not applied, reverted, or a bad value): the
# dispatcher reads its backend here, so that it never needs the patcher.
_current: Config | None = None


def set_current(cfg: Config | None) -> None:
    global _current
    _current = cfg


def current_backend() -> str:
    """GEMM_PATCH_BACKEND as the last apply() read it (``auto`` before, or after a bad value)."""
    return _current.backend if _current is not None else "auto"
