"""The Target base: one template for every patch gemm_patch makes.

``Target.patch`` is the only path from a live module to an installed patch: its switch (a
variable, declared as data) -> ``inspect`` the live module -> judge the fingerprint against the
recorded releases -> ``install`` through an ``Undo`` that can put back exactly what it replaced.
A target supplies ``inspect`` and ``install``; its release data (the fingerprints of each
release) is in ``gemm_patch/engine/releases.json``, under its name.
"""

from __future__ import annotations

import gc
import types
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import wrapt

from . import release_data
from .callsite import CallSiteError
from .config import Config

DEFAULTS = Config()  # the configuration of a process with no GEMM_PATCH_* variable set

VERIFIED = "verified"  # the code relied on is the one recorded for this release
COMPATIBLE = "compatible"  # identical to the code of another verified release
UNVERIFIED = "unverified"  # unknown code: left alone
FORCED = "forced"  # unknown code, patched because GEMM_PATCH_ALLOW_UNVERIFIED=1
NOT_APPLICABLE = "not applicable"
SKIPPED = "skipped"  # could not be inspected, or the live object is not the one on disk
PENDING = "pending"  # its module is not imported yet: patched right after its import
OFF = "off"
REPLACED = "replaced"  # another object sits where gemm_patch's was: left as it is
BYPASSED = "bypassed"  # patched, but objects built before the install still run upstream's code

PATCHED_STATES = frozenset({VERIFIED, COMPATIBLE, FORCED})
TROUBLED_STATES = frozenset({UNVERIFIED, SKIPPED, REPLACED, BYPASSED})  # a WARNING: not patched where it should be

# What each state means, for `gemm-patch status` (a target adds its own in ``extra_states``).
STATE_MEANINGS = {
    VERIFIED: "patched: the code is the one recorded for this release",
    COMPATIBLE: "patched: the code is identical to another verified release's",
    FORCED: "patched although unknown, because GEMM_PATCH_ALLOW_UNVERIFIED=1",
    UNVERIFIED: "left alone: the code differs from every recorded release",
    SKIPPED: "left alone: the code could not be read, or is not the file's own",
    REPLACED: "something else was installed over gemm_patch's object since",
    BYPASSED: "patched, but objects built before gemm_patch.apply() still run megatron's own code",
    PENDING: "waiting: patched right after its module is imported",
    OFF: "turned off by a variable, revert(), or not applied",
    NOT_APPLICABLE: "nothing to fix in what is installed",
}

ALLOW_UNVERIFIED = "GEMM_PATCH_ALLOW_UNVERIFIED"


# The states of every target now (name -> state), for a patch that asks at run time how the
# others stand (nemo-fsdp-gaf): the patcher's status(), handed down by ``use_targets``, so that
# no target module imports the patcher.
_states_reader: Callable[[], Mapping[str, str]] = dict


def read_states_with(reader: Callable[[], Mapping[str, str]]) -> None:
    global _states_reader
    _states_reader = reader


def current_states() -> Mapping[str, str]:
    """Every registered target's state now (as ``status()`` reports it)."""
    return _states_reader()


# The patcher's search for instances built before their target's install (``look_again``),
# handed down by ``use_targets`` as the states reader is.
def _no_search() -> None:
    return None


_searcher: Callable[[], None] = _no_search


def search_with(searcher: Callable[[], None]) -> None:
    global _searcher
    _searcher = searcher


def look_again() -> None:
    """A patched code path met an object built outside the patch: search the process again for
    instances built before their install (at most once per ``apply()``), so that status says so."""
    _searcher()


@dataclass
class TargetStatus:
    name: str
    module: str
    state: str
    reason: str
    version: str | None = None
    fingerprint: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Refused(Exception):
    """Strict mode: a target that is not patched for a reason strict mode does not accept."""


@dataclass(frozen=True)
class Step:
    """One assignment an install made: ``owner.name = installed`` (``owner[name]`` where
    ``is_item``: a ``sys.modules`` entry), and what was there before (``original``, or nothing
    where not ``existed``)."""

    owner: Any
    name: str
    original: Any
    existed: bool
    installed: Any
    is_item: bool = False

    def current(self) -> Any:
        """What the place holds now (``ABSENT`` where nothing)."""
        return self.owner.get(self.name, ABSENT) if self.is_item else vars(self.owner).get(self.name, ABSENT)

    def in_place(self) -> bool:
        return self.current() is self.installed

    def where(self) -> str:
        if self.is_item:
            return f"sys.modules[{self.name!r}]"
        owner = self.owner
        return f"{getattr(owner, '__qualname__', getattr(owner, '__name__', type(owner).__name__))}.{self.name}"

    def restore(self) -> None:
        """Put back what was there before (nothing, where nothing was)."""
        if self.is_item:
            if self.existed:
                self.owner[self.name] = self.original
            else:
                del self.owner[self.name]
        elif self.existed:
            setattr(self.owner, self.name, self.original)
        else:
            delattr(self.owner, self.name)


@dataclass
class Undo:
    """Assignments to reverse, newest last. Each step remembers what it installed, so ``run``
    restores only what is still gemm_patch's and reports the rest instead of dropping it."""

    steps: list[Step] = field(default_factory=list)
    # Objects built before the install and brought under it afterwards, each with the function
    # that puts it back (weakly held: an undo never keeps a model alive).
    adopted: list[tuple[weakref.ref, Callable[[Any], None]]] = field(default_factory=list)

    def adopt(self, obj: Any, put_back: Callable[[Any], None]) -> None:
        """``obj`` was brought under this install; ``run`` calls ``put_back(obj)`` if it lives."""
        self.adopted.append((weakref.ref(obj), put_back))

    def set(self, owner: Any, attribute: str, value: Any) -> None:
        existed = attribute in vars(owner)
        self.steps.append(Step(owner, attribute, vars(owner).get(attribute), existed, value))
        setattr(owner, attribute, value)

    def set_item(self, mapping: dict, key: str, value: Any) -> None:
        self.steps.append(Step(mapping, key, mapping.get(key), key in mapping, value, is_item=True))
        mapping[key] = value

    def in_place(self) -> list[str]:
        """What no longer holds gemm_patch's object (empty when everything is in place)."""
        return [step.where() for step in self.steps if not step.in_place()]

    def run(self) -> list[str]:
        """Put back every original that still sits under gemm_patch's object; return a
        description of each place left alone because something else was put there since."""
        left = []
        for ref, put_back in reversed(self.adopted):
            obj = ref()
            if obj is not None:
                put_back(obj)
        self.adopted.clear()
        for step in reversed(self.steps):
            if step.in_place():
                step.restore()
            else:
                left.append(f"{step.where()} is now {_describe(step.current())}")
        self.steps.clear()
        return left


ABSENT = object()  # what ``Step.current`` returns for a place that holds nothing


def _describe(obj: Any) -> str:
    if obj is ABSENT:
        return "deleted"
    return f"{type(obj).__module__}.{type(obj).__qualname__} object"


@dataclass(frozen=True)
class Inspection:
    """What ``Target.inspect`` found: the fingerprint of the code the patch relies on, whether
    the patch applies, why (a phrase naming what was found or missing), and whatever ``install``
    needs (``payload``)."""

    fingerprint: str | None
    applicable: bool
    reason: str
    payload: Any = None
    # The fingerprint of the same code without its docstrings (``callsite.code_fingerprint``),
    # where the target takes one: a change upstream recorded as a fix is known by its code alone.
    code_fingerprint: str | None = None


def public_version(version: str | None) -> str:
    """``0.18.2+e1a6d4d`` -> ``0.18.2``: megatron-core >= 0.18 appends the git hash of any
    checkout it sits in; the fingerprint, not the suffix, decides whether the code is known."""
    if not version:
        return ""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).public
    except InvalidVersion:
        return version


@dataclass(frozen=True, kw_only=True, eq=False)
class Target:
    name: str
    distribution: str  # whose version keys ``fingerprints``
    module: str  # the module whose import triggers the patch
    # Public release -> fingerprint of the code relied on. None (the default): the target's
    # entry in gemm_patch/engine/releases.json, as is ``fixed_upstream``; tests pass tables of their own.
    fingerprints: Mapping[str, str] = None  # type: ignore[assignment]
    switch: str = ""  # the variable that turns this target off; "" derives GEMM_PATCH_<NAME>
    default_on: bool = True  # False: opt-in, the variable must be set to 1
    switch_values: tuple[str, ...] = ()  # named values the variable accepts beside 0/1 (``Config.choice``)
    relies_on: str = "code"  # what the fingerprint covers, in reasons
    # Fingerprints of upstream code that fixes the defect itself -> the upstream change: such code
    # reads "not applicable" (nothing to fix), where any other unknown code reads "unverified".
    fixed_upstream: Mapping[str, str] = None  # type: ignore[assignment]
    # Fingerprints of code that has nothing for this target to fix although ``inspect`` finds it
    # (the function exists, without the call or statement the target patches) -> what that code
    # is. Code without the site whose fingerprint is in neither table reads "unverified": it may
    # hold the same defect in another form, which no source match can tell. None (the default):
    # the entry's ``not_applicable`` table, plus every fingerprint of its ``other_form`` target
    # (two targets that patch two forms of one function: a release has one form or the other).
    not_applicable: Mapping[str, str] = None  # type: ignore[assignment]

    # States of this target's own beyond the common ones (state -> meaning), and whether each
    # counts as applying to what is installed (shown by `gemm-patch status` without --all).
    extra_states: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.fingerprints is None or self.fixed_upstream is None or self.not_applicable is None:
            entry = release_data.entry(self.name)
            if self.fingerprints is None:
                object.__setattr__(self, "fingerprints", dict(entry["fingerprints"]))
            if self.fixed_upstream is None:
                object.__setattr__(self, "fixed_upstream", dict(entry.get("fixed_upstream", {})))
            if self.not_applicable is None:
                object.__setattr__(self, "not_applicable", release_data.not_applicable(self.name))

    @property
    def switch_variable(self) -> str:
        return self.switch or "GEMM_PATCH_" + self.name.upper().replace("-", "_")

    def expected_state(self, version: str | None) -> str:
        """What the version matrix expects on an unmodified release."""
        return VERIFIED if public_version(version) in self.fingerprints else NOT_APPLICABLE

    # -- what a target supplies ---------------------------------------------------------------

    def precheck(self, module: types.ModuleType, cfg: Config) -> tuple[str, str] | None:
        """A (state, reason) that settles the target before any inspection, or None."""
        return None

    def inspect(self, module: types.ModuleType, cfg: Config = DEFAULTS) -> Inspection:
        """Read the live module (and its source) under ``cfg`` (the defaults where a tool such as
        ``compat/fingerprint.py`` only reads it); raise ``callsite.CallSiteError`` to skip."""
        raise NotImplementedError

    def install(self, module: types.ModuleType, found: Inspection, undo: Undo, cfg: Config) -> str | None:
        """Make the patch, every assignment through ``undo``; may return a note for the reason
        (what an optional part, under its own switch in ``options``, did)."""
        raise NotImplementedError

    @property
    def options(self) -> Mapping[str, bool]:
        """Switches of optional parts of this target (variable -> default), beside its own."""
        return {}

    def in_place(self, module: types.ModuleType, undo: Undo) -> str | None:
        """None while the installed patch is what ``module`` uses; otherwise what is there."""
        left = undo.in_place()
        return f"{', '.join(left)} no longer gemm_patch's" if left else None

    def home(self, module: types.ModuleType) -> types.ModuleType:
        """The module whose objects ``install`` replaces when ``module`` is imported: ``module``
        itself, unless the target patches another module that this one imports."""
        return module

    def built_classes(self, undo: Undo) -> tuple[type, ...]:
        """The classes whose instances take this patch once, when they are built (hooks
        registered as closures, settings recorded in ``__init__``), among what ``undo``
        patched: an instance built before the install keeps upstream's code. Empty (the
        default): megatron looks the patched code up at every call."""
        return ()

    def runs_patched(self, instance: Any, undo: Undo) -> bool:
        """Whether ``instance`` (of one of ``built_classes``) runs this patch, after bringing
        it under the patch where that can be done exactly (``undo``: the install's, which puts
        it back)."""
        return True

    # What an instance in ``left_without`` meets once the patch is out, and what to do.
    without_it = ""

    def left_without(self) -> list:
        """The live instances built under this patch that cannot run now that it is taken out
        (their build relied on what it provided). Empty (the default)."""
        return []

    def kept_patched(self) -> list:
        """The live instances built under this patch that keep running it when it is taken out
        (what it set up at their build, which cannot be swapped back exactly). Empty (the
        default): taking the patch out takes it out of every instance."""
        return []

    # -- what a target says ---------------------------------------------------------------

    def summary_part(self, st: TargetStatus) -> str:
        """This target's words in the summary log line."""
        if st.state in (UNVERIFIED, SKIPPED):
            return f"{st.name} {st.state}: {st.reason}"
        if st.state == OFF:
            return f"{st.name} off ({st.reason})"
        return f"{st.name} {st.state}"

    def status_fields(self, st: TargetStatus | None) -> dict[str, tuple[str, str]]:
        """Top-level fields this target adds to ``status()`` (name -> (word, meaning))."""
        return {}

    # -- the template ------------------------------------------------------------------------

    def patch(self, module: types.ModuleType, version: str | None, cfg: Config) -> tuple[TargetStatus, Undo]:
        """Judge and, where proven, patch ``module``. Raises ``Refused`` under strict mode for
        unknown code and for a skip; every other outcome is a status."""
        def status(state: str, reason: str, fp: str | None = None) -> TargetStatus:
            return TargetStatus(self.name, self.module, state, reason, version, fp)

        off = self.switched_off(cfg)
        if off:
            return status(OFF, off), Undo()
        settled = self.precheck(module, cfg)
        if settled is not None:
            return status(*settled), Undo()
        try:
            found = self.inspect(module, cfg)
        except CallSiteError as exc:
            if cfg.strict:
                raise Refused(f"{self.name}: {exc}; refused because GEMM_PATCH_STRICT=1") from None
            return status(SKIPPED, str(exc)), Undo()
        fixed = (self.fixed_upstream.get(found.fingerprint or "")
                 or self.fixed_upstream.get(found.code_fingerprint or ""))
        if fixed:
            return status(NOT_APPLICABLE, f"{found.reason}: fixed upstream ({fixed}); nothing to patch",
                          found.fingerprint), Undo()
        if not found.applicable:
            state, reason = self.judge_without_site(version, found, cfg)
            if state == UNVERIFIED and cfg.strict:
                raise Refused(f"{self.name}: {reason}; refused because GEMM_PATCH_STRICT=1")
            return status(state, reason, found.fingerprint), Undo()
        state, reason = self.judge(version, found, cfg)
        if state == UNVERIFIED:
            if cfg.strict:
                raise Refused(f"{self.name}: {reason}; refused because GEMM_PATCH_STRICT=1")
            return status(state, reason, found.fingerprint), Undo()
        undo = Undo()
        note = self.install(module, found, undo, cfg)
        return status(state, f"{reason}; {note}" if note else reason, found.fingerprint), undo

    def switched_off(self, cfg: Config) -> str | None:
        """Why the configuration turns this target off (the reason its status gives), or None."""
        if self.name in cfg.left_out:
            return "GEMM_PATCH_DISABLE lists it"
        if not cfg.switch_on(self.switch_variable, self.default_on):
            return f"{self.switch_variable}=0" if self.default_on else f"opt-in: set {self.switch_variable}=1 to enable"
        return None

    def _unknown(self, version: str | None, fp: str | None) -> str:
        recorded = self.fingerprints.get(public_version(version))
        if recorded:
            return f"fingerprint {fp} differs from the recorded {recorded}"
        return (f"{self.distribution} {version or '(unknown version)'} is not a verified release and its "
                f"fingerprint {fp} matches none that is")

    def judge_without_site(self, version: str | None, found: Inspection, cfg: Config) -> tuple[str, str]:
        """Code that ``inspect`` found without what the target patches: not applicable where
        nothing is there to fingerprint (no such module or function) or where the code is
        recorded as having nothing to fix; otherwise unknown code, left alone (with the gate
        open, nothing to patch)."""
        fp = found.fingerprint
        if fp is None:
            return NOT_APPLICABLE, found.reason
        known = self.not_applicable.get(fp)
        if known:
            return NOT_APPLICABLE, f"{found.reason}: {known}; nothing to patch"
        reason = f"{found.reason}, and its {self.relies_on} is unknown ({self._unknown(version, fp)})"
        if cfg.allow_unverified:
            return NOT_APPLICABLE, f"{reason}; nothing to patch there ({ALLOW_UNVERIFIED}=1 accepts unknown code)"
        return UNVERIFIED, (f"{reason}; left alone: the defect may be there in another form "
                            f"({ALLOW_UNVERIFIED}=1 accepts it as nothing to patch)")

    def judge(self, version: str | None, found: Inspection, cfg: Config) -> tuple[str, str]:
        fp, dist = found.fingerprint, self.distribution
        release = public_version(version)
        if self.fingerprints.get(release) == fp:
            return VERIFIED, f"{found.reason}: {self.relies_on} matches {dist} {version}"
        twins = [v for v, known in self.fingerprints.items() if known == fp]
        if twins:
            return COMPATIBLE, (f"{found.reason}: {dist} {version or '(unknown version)'} is not a verified "
                                f"release, but its {self.relies_on} is identical to {dist} {twins[-1]}'s")
        reason = f"{found.reason}: {self.relies_on} unknown ({self._unknown(version, fp)})"
        if cfg.allow_unverified:
            return FORCED, f"{reason}; patched because {ALLOW_UNVERIFIED}=1"
        return UNVERIFIED, f"{reason}; left alone ({ALLOW_UNVERIFIED}=1 patches it)"


@dataclass(frozen=True, kw_only=True, eq=False)
class MethodTarget(Target):
    """A target that replaces one method, ``owner.attribute`` of its module, with a wrapt
    ``FunctionWrapper`` (``__wrapped__`` is megatron's function), marked with the target name."""

    owner: str
    attribute: str
    # The method runs once per instance, when it is built (``built_classes``).
    runs_at_build: bool = False

    @property
    def where(self) -> str:
        return f"{self.owner}.{self.attribute}"

    def built_classes(self, undo: Undo) -> tuple[type, ...]:
        if not self.runs_at_build:
            return ()
        return tuple(step.owner for step in undo.steps
                     if isinstance(step.owner, type) and step.owner.__name__ == self.owner
                     and step.name == self.attribute)

    def live_object(self, module: types.ModuleType) -> Any:
        cls = vars(module).get(self.owner)
        return vars(cls).get(self.attribute) if isinstance(cls, type) else None

    def replace(self, module: types.ModuleType, undo: Undo, wrapper: Any) -> None:
        wrapper._self_gemm_patch_target = self.name
        undo.set(getattr(module, self.owner), self.attribute, wrapper)

    def in_place(self, module: types.ModuleType, undo: Undo) -> str | None:
        live = self.live_object(module)
        if getattr(live, "_self_gemm_patch_target", None) != self.name:
            return f"{module.__name__}.{self.where} is now {_describe(live)}, not gemm_patch's wrapper"
        return Target.in_place(self, module, undo)  # the classes of an earlier execution too


class PatchedTwin(wrapt.FunctionWrapper):
    """The installed object for every twin: a wrapt FunctionWrapper around the upstream function
    (``__wrapped__`` is it, so introspection sees its name, doc and signature) whose calls run the
    twin instead. A twin bound by a class body as a ``staticmethod`` is called with the arguments
    as given; a plain method also receives the instance it was looked up on."""

    def __init__(self, original: Any, twin: Any) -> None:
        static = isinstance(twin, (staticmethod, classmethod))
        function = twin.__func__ if static else twin

        def run_twin(wrapped, instance, args, kwargs):
            return function(*args, **kwargs) if static else function(instance, *args, **kwargs)

        super().__init__(original, run_twin)
        self._self_gemm_patch_twin = twin


T = TypeVar("T", bound="Target")

# Megatron-FSDP ships twice: inside megatron-core (this package) and on its own as megatron-fsdp
# (imported as ``megatron_fsdp``), the same code keyed by each distribution's versions.
MCORE_FSDP_PACKAGE = "megatron.core.distributed.fsdp.src.megatron_fsdp"


def in_both_fsdp_packages(make: Callable[..., T], name: str, submodule: str, **fields: Any) -> tuple[T, T]:
    """The target ``name`` for megatron-core's Megatron-FSDP and ``m<name>`` for megatron-fsdp's,
    one switch for both: ``make(name=, distribution=, module=, **fields)``; a field's ``{package}``
    is that copy's package (``megatron.core.distributed.fsdp.src.megatron_fsdp`` or ``megatron_fsdp``)."""
    def one(prefix: str, distribution: str, package: str) -> T:
        own = {k: v.format(package=package) if isinstance(v, str) and "{package}" in v else v
               for k, v in fields.items()}
        return make(name=prefix + name, distribution=distribution, module=f"{package}.{submodule}", **own)
    return one("", "megatron-core", MCORE_FSDP_PACKAGE), one("m", "megatron-fsdp", "megatron_fsdp")


def instances_of(classes: set[type]) -> list:
    """Every live instance of ``classes`` and their subclasses: the collector's referrers of
    those classes (an instance of a class defined in Python refers to its class, and the
    collector tracks it), one pass in C over the objects it tracks."""
    kinds, todo = set(), list(classes)
    while todo:
        cls = todo.pop()
        if cls not in kinds:
            kinds.add(cls)
            todo += cls.__subclasses__()
    # type(), not __class__: a proxy's would name what it wraps
    return [obj for obj in gc.get_referrers(*kinds) if type(obj) in kinds]
