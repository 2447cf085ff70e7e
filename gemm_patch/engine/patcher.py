"""The one place that decides what gets patched, when, and how it is undone.

``apply()`` reads the configuration once, watches each target module (``imports.watch``: the
hook runs after every execution of the module, so re-imports and reloads are patched too) and
patches the modules already imported, with every earlier module object of those names it has
seen (megatron may still run one from before a fresh import) and, after a reload, the earlier
classes it had patched. ``revert()`` replays each install's undo list, leaving alone (and
reporting) whatever is no longer gemm_patch's. One lock makes both idempotent and thread-safe;
the watches stay, and do nothing while the patch is reverted (they still note each execution).

The patcher knows no target by name: the package hands it the registry (``use_targets``) and its
version (``use_version``).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..gemm import active
from ..support.module_state import module_findable, still_importing
from . import config, detection, imports, release_data
from .callsite import same_function
from .report import Status, SummaryLog, configure_logging, emit, log
from .target import (
    BYPASSED,
    NOT_APPLICABLE,
    OFF,
    PATCHED_STATES,
    PENDING,
    REPLACED,
    SKIPPED,
    TROUBLED_STATES,
    Refused,
    Target,
    TargetStatus,
    Undo,
    instances_of,
    public_version,
    read_states_with,
    search_with,
)

__all__ = ["GemmPatchError", "Status", "apply", "revert", "status", "import_target_modules", "log", "use_targets",
           "use_version"]

DISABLED_REASON = "GEMM_PATCH=0: nothing is applied, through any entry point"
# What a bad value read by apply() in a process already patched does: nothing.
KEPT = "apply() changed nothing: the configuration applied earlier stays in force (revert() unpatches)"


class GemmPatchError(RuntimeError):
    """Raised only in strict mode (``GEMM_PATCH_STRICT=1`` or ``apply(strict=True)``)."""


@dataclass
class _Install:
    module: types.ModuleType  # the execution of the target's module it was made for
    home: types.ModuleType  # the module whose objects it patched (``Target.home``)
    undo: Undo
    status: TargetStatus  # the verdict it was made under
    # A later execution of the module made newer objects: this install still patches the objects
    # that code imported earlier may hold (a class, a module object), and revert() restores them,
    # but what the re-execution itself overwrote is no reason for a warning.
    superseded: bool = False


@dataclass
class _State:
    cfg: config.Config | None = None  # the configuration of the last apply(); None: not applied
    config_error: str | None = None
    disabled: str | None = None
    statuses: dict[str, TargetStatus] = field(default_factory=dict)
    installs: dict[str, list[_Install]] = field(default_factory=dict)  # target -> oldest first
    watched: set[str] = field(default_factory=set)
    # Every module object of each watched name gemm_patch has seen, oldest first: an earlier one
    # (from before ``del sys.modules[...]`` and a fresh import) stays reachable through whatever
    # imported from it, and apply() patches it again after a revert().
    seen: dict[str, list[types.ModuleType]] = field(default_factory=dict)
    # target -> (class, attribute) its installs patched, weakly: a reload's earlier classes.
    classes: dict[str, list[tuple[weakref.ref, str]]] = field(default_factory=dict)
    judged: dict[tuple[str, int], TargetStatus] = field(default_factory=dict)  # (target, id(module in seen))
    summary: SummaryLog = field(default_factory=SummaryLog)
    warned: set[str] = field(default_factory=set)
    # target -> its instances built before its install that still run upstream's code (weakly:
    # one that is gone stops counting), from the last search (``_search_built_before``).
    bypassed: dict[str, weakref.WeakSet] = field(default_factory=dict)
    to_search: set[str] = field(default_factory=set)  # targets installed anew since the last search
    looked_again: bool = False  # a patched code path asked for a search since the last apply()


_lock = threading.RLock()
_state = _State()
_targets: tuple[Target, ...] = ()
_components: dict[str, str] = {}  # top-level package of a target module -> its distribution
_version = "unknown"  # gemm_patch's own, for status()


def use_targets(targets: Sequence[Target]) -> None:
    """The targets to patch (the package's registry); set once, at ``import gemm_patch``."""
    global _targets, _components
    with _lock:
        _targets = tuple(targets)
        _components = {t.module.split(".")[0]: t.distribution for t in _targets}
        read_states_with(lambda: {t.name: t.state for t in status().targets})
        search_with(_look_again)


def use_version(version: str) -> None:
    """gemm_patch's version, as status() reports it; set once, at ``import gemm_patch``."""
    global _version
    _version = version


def targets() -> tuple[Target, ...]:
    return _targets


def _switches() -> dict[str, bool]:
    own = {t.switch_variable: config.Named(t.default_on, t.switch_values) if t.switch_values else t.default_on
           for t in _targets}
    return {**own, **{name: on for t in _targets for name, on in t.options.items()}}


def load_config() -> config.Config:
    """Every variable, validated against the registered targets; raises ``config.ConfigError``."""
    return config.load(switches=_switches(), targets=tuple(t.name for t in _targets))


def _read_config(strict: bool | None) -> config.Config | None:
    try:
        cfg = load_config()
        _state.config_error = None
    except config.ConfigError as exc:
        # Applied already: the patches in place keep running under the configuration they were
        # made with; unpatching a training job because a variable changed would be worse.
        kept = f"; {KEPT}" if _state.cfg is not None else ""
        _state.config_error = f"{exc}{kept}"
        if strict or (strict is None and config.strict_requested()):
            raise GemmPatchError(f"gemm_patch: {exc}{kept}") from None
        emit(logging.ERROR, f"gemm_patch: {exc}{kept}" if kept else f"gemm_patch not applied: {exc}")
        return None
    if strict is not None:
        cfg = config.Config(**{**cfg.__dict__, "strict": strict})
    return cfg


def apply(strict: bool | None = None) -> Status:
    """Patch every target now or, for modules not yet imported, right after their import.

    ``strict`` overrides ``GEMM_PATCH_STRICT``. Calling it again is a no-op for what is still
    in place. Under ``GEMM_PATCH=0`` it applies nothing and the status says why."""
    apply_quietly(strict)
    return status()


def apply_quietly(strict: bool | None = None) -> None:
    """``apply()`` without building the status (which reads installed versions from metadata,
    milliseconds that ``import gemm_patch`` need not spend)."""
    if not config.enabled():
        with _lock:
            # GEMM_PATCH=0 set after a patch: what runs must be what status says (nothing).
            if _state.installs:
                _uninstall_all(f"{DISABLED_REASON} (set after the patch; apply() took it out)")
                emit(logging.WARNING, "gemm_patch: GEMM_PATCH=0 at apply(): every patch in place taken out")
            _state.cfg = None
            _state.disabled = DISABLED_REASON
        return
    damaged = release_data.problem()
    if damaged:  # no fingerprint can be trusted: nothing is patched
        if strict or (strict is None and config.strict_requested()):
            raise GemmPatchError(f"gemm_patch: {damaged}")
        with _lock:
            _warn_once("release-data", f"gemm_patch not applied: {damaged}", logging.ERROR)
        return
    _wait_for_half_imported_modules()
    with _lock:
        _state.disabled = None
        cfg = _read_config(strict)
        if cfg is None:
            return
        configure_logging(cfg.log_level)
        _state.cfg = cfg
        active.use_backend(cfg.backend)
        for target in _targets:
            off = target.switched_off(cfg)
            if off and _state.installs.get(target.name):
                # Turned off since it was installed: taken out, so that what runs is what is asked.
                _uninstall(target.name, off)
                emit(logging.WARNING, f"gemm_patch: {target.name}: {off}: its patch taken out by apply()")
                continue
            if target.name not in _state.statuses or _state.statuses[target.name].state == OFF:
                _state.statuses[target.name] = (TargetStatus(target.name, target.module, OFF, off) if off else
                                                TargetStatus(target.name, target.module, PENDING,
                                                             f"waiting for `import {target.module}`"))
        for name in sorted({t.module for t in _targets}):
            if name not in _state.watched:
                _state.watched.add(name)
                imports.watch(name, _on_exec)
            live = sys.modules.get(name)
            for module in [m for m in _state.seen.get(name, ()) if m is not live]:
                _patch_module(module, reexecuted=False)
            if live is not None and not still_importing(live):
                _patch_module(live, reexecuted=False)
        _state.looked_again = False
        installed, _state.to_search = _state.to_search, set()
        # Strict mode refuses an instance that runs upstream's code whenever it is asked, also on an
        # apply() that installs nothing new: every installed target is searched again. Otherwise the
        # targets installed anew, and those with instances left on upstream's code, which an
        # apply() made inside a backward could not bring under (the next one can).
        waiting = {name for name, objs in _state.bypassed.items() if len(objs)}
        _search_built_before(set(_state.installs) if cfg.strict else installed | waiting)


def _wait_for_half_imported_modules() -> None:
    """A target module another thread is still executing is patched once its import is done:
    patching the half-built module would fail and never be retried. Waits outside the lock; a
    module this thread is itself executing is patched from a helper thread when it is done."""
    for name in sorted({t.module for t in _targets}):
        module = sys.modules.get(name)
        if module is None or not still_importing(module):
            continue
        if imports.wait_until_imported(name) is None:
            threading.Thread(target=_patch_when_imported, args=(name,), daemon=True,
                             name=f"gemm_patch-wait-{name}").start()


def _patch_when_imported(name: str) -> None:
    module = imports.wait_until_imported(name)
    if module is not None:
        with _lock:
            if _state.cfg is not None:
                _patch_module(module, reexecuted=False)


def revert() -> Status:
    """Restore every patched object to the exact original (on every module object a patch was
    installed on); a no-op when nothing is applied. What something else has replaced since is
    left as it is, with one warning."""
    with _lock:
        _state.cfg = None
        _uninstall_all("reverted by gemm_patch.revert()")
        return status()


def _uninstall_all(reason: str) -> None:
    _state.bypassed.clear()
    _state.to_search.clear()
    for name in list(_state.installs):
        _uninstall(name, reason)
    for name, st in _state.statuses.items():
        if st.state != REPLACED:
            _state.statuses[name] = TargetStatus(name, st.module, OFF, reason, st.version, st.fingerprint)


def _uninstall(name: str, reason: str) -> None:
    """Undo every install of the target ``name``, newest first; its status becomes ``off`` for
    ``reason``, or ``replaced`` where something installed over gemm_patch's object stays."""
    left = []
    for install in reversed(_state.installs.pop(name, [])):
        kept = install.undo.run()
        if not install.superseded:
            left += kept
    _state.bypassed.pop(name, None)
    st = _state.statuses[name]
    if left:
        why = f"revert() left {'; '.join(left)} (installed over gemm_patch's object)"
        _warn_once(f"revert:{name}", f"{name}: {why}")
        _state.statuses[name] = TargetStatus(name, st.module, REPLACED, why, st.version, st.fingerprint)
    else:
        _state.statuses[name] = TargetStatus(name, st.module, OFF, reason, st.version, st.fingerprint)
    target = next((t for t in _targets if t.name == name), None)
    stranded = _stranded(target) if target is not None else None
    if stranded:
        emit(logging.WARNING, f"{name}: taken out ({reason}), but {stranded}")


def _stranded(target: Target) -> str | None:
    """What ``target.left_without()`` finds, said, or None."""
    objs = target.left_without()
    if not objs:
        return None
    kinds = ", ".join(sorted({type(obj).__name__ for obj in objs}))
    return f"{len(objs)} {kinds} built under it cannot run without it: {target.without_it}"


def _on_exec(module: types.ModuleType) -> None:
    with _lock:
        _remember(module)
        if _state.cfg is not None:
            _patch_module(module, reexecuted=True)


def _patch_module(module: types.ModuleType, reexecuted: bool) -> None:
    """Patch every target of ``module``; ``reexecuted``: its code has just run (again), so its
    names hold new objects, while the objects of an earlier execution (still held by whatever
    imported them) keep their patch."""
    cfg = _state.cfg
    _remember(module)
    live = sys.modules.get(module.__name__)
    version = _distribution_version(module)
    done = []
    for target in _targets:
        if target.module != module.__name__:
            continue
        installs = _state.installs.setdefault(target.name, [])
        own = _install_for(target, module)
        if own is not None:
            if target.in_place(module, own.undo) is None and not (reexecuted and _assigns_on(module, own.undo)):
                own.module = module  # apply() again, or its objects live in a module that did not run again
                if live is module:
                    _state.statuses[target.name] = own.status
                continue
            if not reexecuted:
                own.undo.run()  # replaced by someone else: put back what is still ours, patch anew
                installs.remove(own)
        for install in installs:
            install.superseded = True
        try:
            st, undo = target.patch(module, version, cfg)
        except Refused as exc:
            _state.statuses[target.name] = TargetStatus(target.name, target.module, SKIPPED, str(exc), version)
            raise GemmPatchError(str(exc)) from None
        except Exception as exc:  # a fault in the patcher must not break the import
            if cfg.strict:
                raise
            st, undo = TargetStatus(target.name, target.module, SKIPPED,
                                    f"internal error while patching: {type(exc).__name__}: {exc}", version), Undo()
        if undo.steps:
            _inherit_originals(undo, installs)
            _extend_to_earlier_classes(target, undo)
            installs.append(_Install(module, _home(target, module), undo, st))
            if not reexecuted:  # its classes may have instances already, built without the patch
                _state.to_search.add(target.name)
        _state.judged[(target.name, id(module))] = st
        if live is module or live is None:  # an earlier module object's verdict is checked by status()
            _state.statuses[target.name] = st
            done.append((target, st))
    if done:
        _state.summary.record(_components.get(module.__name__.split(".")[0], "megatron-core"), version,
                              done, _backend_summary())


def _search_built_before(names: set[str]) -> None:
    """Find the instances of the classes that the named targets' installs patched at build
    (``Target.built_classes``), built before the install, only where such a class is patched.
    Each instance the target cannot bring under its patch exactly (``Target.runs_patched``)
    makes the target read ``bypassed`` while it lives, with one WARNING; strict mode refuses it."""
    classes = {t: found for t in _targets if t.name in names
               if (found := [(c, i.undo) for i in _state.installs.get(t.name, ()) for c in t.built_classes(i.undo)])}
    if not classes:
        return
    early: dict[Target, list] = {t: [] for t in classes}
    for obj in instances_of({c for found in classes.values() for c, _ in found}):
        for target, found in classes.items():
            # the newest install on a class of obj: its undo puts obj back
            undo = next((u for c, u in reversed(found) if issubclass(type(obj), c)), None)
            if undo is not None and not target.runs_patched(obj, undo):
                early[target].append(obj)
    refused = []
    for target, objs in early.items():
        _state.bypassed[target.name] = weakref.WeakSet(objs)
        why = _bypassed(target)
        if why is not None:
            _warn_once(f"bypassed:{target.name}", f"{target.name}: {why}")
            refused.append(f"{target.name}: {why}")
    if refused and _state.cfg is not None and _state.cfg.strict:
        raise GemmPatchError(f"{'; '.join(refused)}; refused because GEMM_PATCH_STRICT=1")


def _look_again() -> None:
    """``target.look_again``: a search of every installed target, once per ``apply()``."""
    with _lock:
        if _state.cfg is None or _state.looked_again:
            return
        _state.looked_again = True
        try:
            _search_built_before(set(_state.installs))
        except GemmPatchError:
            pass  # strict mode refuses at apply(); in a backward the status and the warning say it


def _bypassed(target: Target) -> str | None:
    """Why ``target`` reads ``bypassed`` (its instances built before the install that are
    still alive), or None."""
    alive = list(_state.bypassed.get(target.name, ()))
    if not alive:
        return None
    kinds = ", ".join(sorted({type(obj).__name__ for obj in alive}))
    one = len(alive) == 1
    where = getattr(target, "where", target.module)
    return (f"{len(alive)} {kinds} built before gemm_patch.apply() keep{'s' if one else ''} what megatron's own "
            f"{where} set up when {'it was' if one else 'they were'} built, which {target.name}'s fix does not "
            f"reach; build the model after the patch: run the job under `gemm-patch run`, set GEMM_PATCH_AUTO=1, "
            f"or import gemm_patch before building the model (docs/troubleshooting.md)")


def _remember(module: types.ModuleType) -> None:
    seen = _state.seen.setdefault(module.__name__, [])
    if not any(m is module for m in seen):
        seen.append(module)


def _home(target: Target, module: types.ModuleType) -> types.ModuleType:
    try:
        return target.home(module)
    except Exception:  # its other module cannot be imported: the install is judged on this one
        return module


def _install_for(target: Target, module: types.ModuleType) -> _Install | None:
    """The newest install of ``target`` on the objects that ``module`` uses."""
    home = _home(target, module)
    return next((i for i in reversed(_state.installs.get(target.name, ())) if i.home is home), None)


def _extend_to_earlier_classes(target: Target, undo: Undo) -> None:
    """A module run again (``importlib.reload``) binds new classes, while the classes of its
    earlier execution stay reachable (imported by name elsewhere, the classes of live
    objects). Each earlier class of the same name that an install of this target patched gets
    the same object where its attribute is the very function this install replaced (equal code
    at every decorator layer, the same globals: a reload runs in the same module dict)."""
    history = [(ref, name) for ref, name in _state.classes.get(target.name, ()) if ref() is not None]
    for step in list(undo.steps):
        owner = step.owner
        if not isinstance(owner, type):
            continue
        for ref, name in history:
            earlier = ref()
            if (earlier is not owner and name == step.name and earlier.__qualname__ == owner.__qualname__
                    and earlier.__module__ == owner.__module__
                    and same_function(vars(earlier).get(name), step.original)):
                undo.set(earlier, name, step.installed)
    for step in undo.steps:
        if isinstance(step.owner, type) and not any(ref() is step.owner and name == step.name
                                                    for ref, name in history):
            history.append((weakref.ref(step.owner), step.name))
    _state.classes[target.name] = history


def _inherit_originals(undo: Undo, earlier: list[_Install]) -> None:
    """A module executed again while an earlier install was in place may have taken gemm_patch's
    object as its own (apex's stand-in, imported from sys.modules, and the flag it sets): what
    revert() puts back there is what the earlier install replaced, never gemm_patch's object."""
    for i, step in enumerate(undo.steps):
        for install in earlier:
            match = next((before for before in install.undo.steps
                          if before.name == step.name and before.is_item == step.is_item and step.existed
                          and step.original is before.installed), None)
            if match is not None:
                undo.steps[i] = dataclasses.replace(step, original=match.original, existed=match.existed)
                break


def _assigns_on(module: types.ModuleType, undo: Undo) -> bool:
    """Whether an install assigned anything on ``module`` (or an earlier object of that name) or
    on a class it defines."""
    return any((step.owner.__name__ if isinstance(step.owner, types.ModuleType)
                else getattr(step.owner, "__module__", None)) == module.__name__ for step in undo.steps)


def _distribution_version(module: types.ModuleType) -> str | None:
    component = _components.get(module.__name__.split(".")[0])
    return detection.distribution_version(component) if component else None


def _backend_summary() -> str:
    return "backends " + ">".join(active.active_dispatcher().order)


def _warn_once(key: str, message: str, level: int = logging.WARNING) -> None:
    if key not in _state.warned:
        _state.warned.add(key)
        emit(level, message)


def _not_in_place(target: Target) -> str | None:
    """What of a patched target megatron can reach unpatched: the imported module, and each
    earlier module object of that name (from before a fresh import), must use its install."""
    live = sys.modules.get(target.module)
    if live is not None and _install_for(target, live) is None:
        return f"{target.module} is no longer the imported module"
    earlier = [m for m in _state.seen.get(target.module, ()) if m is not live]
    for module in earlier + ([live] if live is not None else []):
        install = _install_for(target, module)
        if install is not None:
            problem = target.in_place(module, install.undo)
            if problem:
                return problem
            continue
        judged = _state.judged.get((target.name, id(module)))
        if judged is not None and judged.state in TROUBLED_STATES:
            return (f"an earlier module object of {target.module} (from before a fresh import, still reachable) "
                    f"is {judged.state}: {judged.reason}")
    return None


def _live_status(target: Target, cfg: config.Config | None, versions: dict[str, str | None]) -> TargetStatus:
    """The recorded status, checked against the live module: a patch that is no longer what
    the module uses reads ``replaced``; a pending target whose module cannot exist in what is
    installed reads ``not applicable``. ``versions``: the installed versions status() read."""
    st = _state.statuses.get(target.name)
    if st is None:
        why = "GEMM_PATCH=0" if not config.enabled() else "gemm_patch.apply() not called"
        if release_data.problem() and config.enabled():
            why = "gemm_patch's release data is damaged (see above): nothing is applied"
        if cfg is not None and target.name in cfg.left_out:
            why = "GEMM_PATCH_DISABLE lists it"
        return TargetStatus(target.name, target.module, OFF, why)
    if st.state in PATCHED_STATES and _state.installs.get(target.name):
        problem = _not_in_place(target)
        if problem:
            return TargetStatus(st.name, st.module, REPLACED, f"{problem}; gemm_patch.apply() patches it again "
                                f"where it can", st.version, st.fingerprint)
        early = _bypassed(target)
        if early:
            return TargetStatus(st.name, st.module, BYPASSED, early, st.version, st.fingerprint)
    if st.state in (OFF, REPLACED) and not _state.installs.get(target.name):
        stranded = _stranded(target)
        if stranded:
            return TargetStatus(st.name, st.module, st.state, f"{st.reason}; {stranded}", st.version,
                                st.fingerprint)
        kept = target.kept_patched()
        if kept:
            kinds = ", ".join(sorted({type(obj).__name__ for obj in kept}))
            one = len(kept) == 1
            return TargetStatus(st.name, st.module, st.state,
                                f"{st.reason}; {len(kept)} {kinds} built under the patch keep{'s' if one else ''} "
                                f"running it (what {'its' if one else 'their'} build set up stays until "
                                f"{'it is' if one else 'they are'} rebuilt)", st.version, st.fingerprint)
    waiting = st.state == PENDING or (st.state == OFF and cfg is not None and st.reason == target.switched_off(cfg))
    if not waiting or target.module in sys.modules:
        return st
    if module_findable(target.module) is False:
        version = _version_of(target.distribution, versions)
        reason = (f"{target.distribution} {version} has no module {target.module}" if version
                  else f"{target.distribution} is not installed (no {target.module.split('.')[0]} package)")
        return TargetStatus(st.name, st.module, NOT_APPLICABLE, reason, version)
    if st.state == PENDING:
        version = _version_of(target.distribution, versions)
        if _recorded_without(target, version):
            return TargetStatus(st.name, st.module, NOT_APPLICABLE,
                                f"{target.distribution} {version} is a recorded release with nothing for "
                                f"{target.name} to patch (judged again on `import {target.module}`)", version)
    return st


def _version_of(distribution: str, versions: dict[str, str | None]) -> str | None:
    return versions[distribution] if distribution in versions else detection.distribution_version(distribution)


def _recorded_without(target: Target, version: str | None) -> bool:
    """Whether ``version`` is a release some target of the same distribution records, and
    this one does not: its import would read not applicable, as the version matrix checks."""
    release = public_version(version)
    return bool(release) and release not in target.fingerprints and any(
        release in t.fingerprints for t in _targets if t.distribution == target.distribution)


def status() -> Status:
    """A structured snapshot: versions, each target's state and reason, the backend order."""
    with _lock:
        cfg, config_error = _state.cfg, _state.config_error
        enabled = config.enabled()
        if cfg is None and enabled:
            try:
                cfg = load_config()
            except config.ConfigError as exc:
                cfg, config_error = config.Config(), str(exc)
        versions = detection.installed_versions()  # read once: each lookup walks sys.path
        statuses = [_live_status(t, cfg, versions) for t in _targets]
        backends: dict = {}
        applied = _state.cfg is not None  # a bad value apply() read since leaves the earlier patch in force
        if "torch" in sys.modules and (config_error is None or applied):  # never pull torch in just for this
            backends = active.active_dispatcher().describe()
        fields = {}
        for target, st in zip(_targets, statuses, strict=True):
            fields.update(target.status_fields(st))
        meanings = {state: meaning for t in _targets for state, meaning in t.extra_states.items()}
        return Status(_version, applied, (cfg or config.Config()).strict,
                      (cfg or config.Config()).backend, config_error, versions, statuses,
                      backends, fields, None if enabled else DISABLED_REASON,
                      {t.name: t.distribution for t in _targets}, meanings, release_data.problem())


def import_target_modules() -> None:
    """Import every installed target module, so that status() reports what the patch did to
    them rather than that it is waiting for them (``gemm-patch status`` and ``doctor``)."""
    import importlib

    for module in sorted({t.module for t in _targets}):
        try:
            importlib.import_module(module)
        except ImportError:
            pass
