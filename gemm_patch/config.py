"""Environment-variable configuration: parsed once, validated with messages that name the fix.

Every variable is read here and nowhere else, so the order of precedence lives in one place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# The GEMM backends (gemm_patch/backends.py, one class each) in the default preference order.
# native first: on a GPU native and TE write bitwise-identical main_grads (also identical to
# megatron-core 0.19.2's own TE call) at the same GPU time, and native costs less host time per
# call (docs/validation.md). TE stays next for torch builds without mm(..., out_dtype=); the
# exact fallback is always last.
BACKEND_ORDER = ("native", "te", "fallback")
BACKEND_CHOICES = ("auto", *BACKEND_ORDER)  # GEMM_PATCH_BACKEND
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
    choices: Mapping[str, str] = field(default_factory=dict)  # a variable set to a named value -> it

    def switch_on(self, variable: str, default: bool = True) -> bool:
        return self.switches.get(variable, default)

    def choice(self, variable: str) -> str | None:
        """The named value (a ``Named`` switch's, e.g. ``replace``) ``variable`` holds, else None."""
        return self.choices.get(variable)


@dataclass(frozen=True)
class Named:
    """A switch that accepts named values beside on/off (``GEMM_PATCH_APEX=replace``): declared
    by a target as the default of its variable; a named value means on, and is kept in
    ``Config.choices``."""

    default: bool
    values: tuple[str, ...]


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


def _switch(env: Mapping[str, str], name: str, spec: bool | Named, chosen: dict[str, str]) -> bool:
    if not isinstance(spec, Named):
        return _flag(env, name, spec)
    value = (env.get(name) or "").strip().lower()
    if value in spec.values:
        chosen[name] = value
        return True
    try:
        return _flag(env, name, spec.default)
    except ConfigError:
        raise ConfigError(
            f"{name}={env[name]!r} is not accepted; use one of {', '.join(_TRUE + _FALSE + spec.values)} "
            f"(unset means {'1' if spec.default else '0'})"
        ) from None


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
         switches: tuple[str, ...] | Mapping[str, bool | Named] = (), targets: tuple[str, ...] = ()) -> Config:
    """Read every GEMM_PATCH_* variable, each target switch in ``switches`` (names, or name ->
    default for opt-in targets, or -> ``Named`` for one that also accepts named values) and
    ``GEMM_PATCH_DISABLE`` (a subset of ``targets``, the known target names); raise ConfigError
    naming the first bad one. With ``GEMM_PATCH=0`` nothing else is read."""
    env = os.environ if env is None else env
    if not _flag(env, "GEMM_PATCH", True):
        return Config(enabled=False)
    _flag(env, "GEMM_PATCH_AUTO", False)  # read by the start-up hook; validated here for one message
    chosen: dict[str, str] = {}
    return Config(
        enabled=True,
        strict=_flag(env, "GEMM_PATCH_STRICT", False),
        backend=_choice(env, "GEMM_PATCH_BACKEND", BACKEND_CHOICES, "auto"),
        log_level=_choice(env, "GEMM_PATCH_LOG_LEVEL", LOG_LEVEL_CHOICES, "INFO", str.upper),
        allow_unverified=_flag(env, "GEMM_PATCH_ALLOW_UNVERIFIED", False),
        switches={name: _switch(env, name, default, chosen) for name, default in
                  (switches.items() if isinstance(switches, Mapping) else dict.fromkeys(switches, True).items())},
        left_out=_names(env, "GEMM_PATCH_DISABLE", targets),
        choices=chosen,
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
