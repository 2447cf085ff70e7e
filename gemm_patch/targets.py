"""What gets patched: each target is data (where, what call, which versions were verified)
plus ``patch``, which returns a status and the exact undo list.

Adding a megatron-core release is one line in a ``fingerprints`` table (get the value with
``python compat/fingerprint.py``) and one line in ``compat/matrix.toml``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import wrapt

VERIFIED = "verified"
UNVERIFIED = "unverified"
NOT_APPLICABLE = "not applicable"
SKIPPED = "skipped"
PENDING = "pending"
OFF = "off"
APEX_REAL = "apex real"  # apex-wgrad: apex's own extension imported, nothing to provide


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


@dataclass
class Undo:
    """Assignments to reverse, newest last: (owner, name, original, existed, installed), where
    ``installed`` is None for an attribute of ``owner`` and, for a key of the mapping ``owner``
    (``sys.modules``), the value put there."""

    steps: list[tuple[Any, str, Any, bool, Any]] = field(default_factory=list)

    def set(self, owner: Any, attribute: str, value: Any) -> None:
        existed = attribute in vars(owner)
        self.steps.append((owner, attribute, vars(owner).get(attribute), existed, None))
        setattr(owner, attribute, value)

    def set_item(self, mapping: dict, key: str, value: Any) -> None:
        self.steps.append((mapping, key, mapping.get(key), key in mapping, value))
        mapping[key] = value

    def run(self) -> None:
        for owner, name, original, existed, installed in reversed(self.steps):
            if installed is not None:
                # A process-wide registry: put back only what is still ours, so a module
                # imported there since (a real apex) is never removed.
                if owner.get(name) is installed:
                    if existed:
                        owner[name] = original
                    else:
                        del owner[name]
            elif existed:
                setattr(owner, name, original)
            elif name in vars(owner):
                delattr(owner, name)
        self.steps.clear()


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


class UnverifiedRefused(Exception):
    """Raised under strict mode instead of patching an unverified call site."""


def judge(name: str, fingerprints: Mapping[str, str], version: str | None, fp: str, prefix: str,
          what: str, strict: bool, distribution: str = "megatron-core") -> tuple[str, str]:
    """Verified when ``fp`` is the one recorded for this release; otherwise unverified (``what``
    gemm_patch relies on is still there), with the reason, or refused under strict mode."""
    known = fingerprints.get(public_version(version))
    if known == fp:
        return VERIFIED, f"{prefix}: {what} matches {distribution} {version}"
    reason = (f"{prefix}: {distribution} {version} is not a verified release" if known is None
              else f"{prefix}: source differs from {distribution} {version} (fingerprint {fp}, "
                   f"release {known})") + f"; {what} still found"
    if strict:
        raise UnverifiedRefused(f"{name}: {reason}; refused because GEMM_PATCH_STRICT=1")
    return UNVERIFIED, reason


@dataclass(frozen=True)
class CallSiteTarget:
    """Send one call expression inside ``owner.attribute`` of ``module`` to ``replacement``."""

    name: str
    distribution: str
    module: str
    owner: str
    attribute: str
    call: str
    replacement: str  # attribute of gemm_patch.dispatcher
    extra_keywords: Mapping[str, str]
    fingerprints: Mapping[str, str]  # release -> fingerprint of the unpatched function
    # Further calls of the same function sent to the dispatcher where present (call source ->
    # dispatcher attribute); they never decide applicability.
    also: Mapping[str, str] = field(default_factory=dict)

    def patch(self, module: types.ModuleType, version: str | None, strict: bool) -> tuple[TargetStatus, Undo]:
        from . import dispatcher
        from .callsite import CallSiteError, Redirect, analyse, build_twin, find_calls

        def status(state: str, reason: str, fp: str | None = None) -> TargetStatus:
            return TargetStatus(self.name, self.module, state, reason, version, fp)

        where = f"{self.owner}.{self.attribute}"
        try:
            analysed = analyse(module, self.owner, self.attribute, self.call)
        except CallSiteError as exc:
            return status(SKIPPED, str(exc)), Undo()
        fp = analysed.fingerprint
        if not analysed.matches:
            return status(NOT_APPLICABLE, f"no `{self.call}` in {where}", fp), Undo()
        state, reason = judge(self.name, self.fingerprints, version, fp, where,
                              "call site", strict)
        try:
            redirects = [Redirect(analysed.matches, "_gemm_patch_wgrad", getattr(dispatcher, self.replacement),
                                  dict(self.extra_keywords))]
            for i, (call, replacement) in enumerate(self.also.items()):
                matches = find_calls(analysed.funcdef, call)
                if matches:
                    redirects.append(Redirect(matches, f"_gemm_patch_also_{i}", getattr(dispatcher, replacement),
                                              dict(self.extra_keywords)))
            twin = build_twin(analysed, f"{self.owner}.{self.attribute}", redirects)
        except (CallSiteError, SyntaxError) as exc:
            return status(SKIPPED, f"{where} cannot be rebuilt: {exc}", fp), Undo()
        owner = getattr(module, self.owner)
        original = vars(owner)[self.attribute]
        undo = Undo()
        undo.set(owner, self.attribute, PatchedCallSite(original, twin, self.name))
        return status(state, reason, fp), undo


def _run_twin(twin: Callable) -> Callable:
    function = twin.__func__ if isinstance(twin, (staticmethod, classmethod)) else twin

    def wrapper(wrapped, instance, args, kwargs):
        return function(*args, **kwargs)

    return wrapper


class PatchedCallSite(wrapt.FunctionWrapper):
    """The installed object: a wrapt FunctionWrapper around the original (``__wrapped__`` is
    it, so ``inspect.unwrap`` and name/doc/signature introspection see megatron's function),
    whose calls run the rewritten twin."""

    def __init__(self, original: Any, twin: Any, target: str) -> None:
        super().__init__(original, _run_twin(twin))
        self._self_gemm_patch_target = target
        self._self_gemm_patch_twin = twin


FSDP_WGRAD = CallSiteTarget(
    name="fsdp-wgrad",
    distribution="megatron-core",
    module="megatron.core.tensor_parallel.layers",
    owner="LinearWithGradAccumulationAndAsyncCommunication",
    attribute="backward",
    call="torch.matmul(grad_output.t(), total_input, out=weight.main_grad)",
    replacement="fsdp_wgrad",
    extra_keywords={"param": "weight"},
    # 0.18+: megatron's own TE call beside it overwrites too; route it through the dispatcher
    # so it accumulates where Megatron-FSDP's buffer persists (same TE/native numerics).
    also={
        'te_general_gemm(total_input, grad_output, out_dtype=weight.main_grad.dtype, layout="NT", '
        'out=weight.main_grad, grad=True)': "fsdp_wgrad_te",
    },
    fingerprints={
        # 0.13.1 has no such call: not applicable, nothing to record.
        "0.14.0": "7ec854ca9d6a137e",
        "0.15.3": "7ec854ca9d6a137e",
        "0.16.1": "7ec854ca9d6a137e",
        "0.17.1": "7ec854ca9d6a137e",
        "0.18.2": "eeb4af4511d4b4e2",  # the torch.matmul left in the no-TE else-branch
        "0.19.2": "8052bd62d48b6d81",
    },
)



@dataclass(frozen=True)
class ApexWgradTarget:
    """Provide apex's compiled ``extension`` to ``module`` where apex's own did not import.

    The stand-in goes into ``sys.modules`` (for by-name imports such as the deferred embedding
    wgrad in ``megatron/core/utils.py``) and into the module's globals (for the wgrad calls),
    and ``flag`` becomes True (for the constructors' check). A real apex is left alone.
    """

    name: str
    distribution: str
    module: str
    extension: str
    flag: str
    calls: tuple[str, ...]
    fingerprints: Mapping[str, str]  # release -> fingerprint of the apex usage (apex_analysis)

    def patch(self, module: types.ModuleType, version: str | None, strict: bool) -> tuple[TargetStatus, Undo]:
        from . import config
        from .apex_analysis import analyse
        from .apex_stand_in import STAND_IN, is_stand_in
        from .callsite import CallSiteError

        def status(state: str, reason: str, fp: str | None = None) -> TargetStatus:
            return TargetStatus(self.name, self.module, state, reason, version, fp)

        ext, where = self.extension, module.__name__
        present = vars(module).get(ext)
        if present is not None and not is_stand_in(present):
            return status(APEX_REAL, f"apex's {ext} was imported by {where}; used untouched"), Undo()
        elsewhere = sys.modules.get(ext)
        if elsewhere is not None and not is_stand_in(elsewhere):
            return status(SKIPPED, f"{ext} was imported after {where} (which found none); "
                                   "left alone: a real extension is never shadowed"), Undo()
        if not config.load().apex_shim:
            return status(OFF, f"GEMM_PATCH_APEX=0: apex's {ext} is missing and gemm_patch does not "
                               "provide it"), Undo()
        try:
            usage = analyse(module, ext, self.flag, self.calls)
        except CallSiteError as exc:
            return status(SKIPPED, str(exc)), Undo()
        fp = usage.fingerprint
        if usage.guarded_import is None or usage.flag_default is None:
            return status(NOT_APPLICABLE, f"{where} has no guarded `import {ext}` setting {self.flag}",
                          fp), Undo()
        if not usage.calls:
            return status(NOT_APPLICABLE, f"{where} calls none of {ext}.{{{', '.join(self.calls)}}}",
                          fp), Undo()
        provided = f"apex missing: {ext}.{{{', '.join(usage.call_names)}}} provided by gemm_patch"
        state, reason = judge(self.name, self.fingerprints, version, fp, provided,
                              "apex usage", strict)
        undo = Undo()
        undo.set_item(sys.modules, ext, STAND_IN)
        undo.set(module, ext, STAND_IN)
        undo.set(module, self.flag, True)
        return status(state, reason, fp), undo


APEX_WGRAD = ApexWgradTarget(
    name="apex-wgrad",
    distribution="megatron-core",
    module="megatron.core.tensor_parallel.layers",
    extension="fused_weight_gradient_mlp_cuda",
    flag="_grad_accum_fusion_available",
    calls=("wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16"),
    fingerprints={
        # The guarded import, ColumnParallelLinear's check and the two backward calls have not
        # changed from 0.13.1 to 0.19.2 (RowParallelLinear has no check in any of them).
        "0.13.1": "08d38a954a90ad6e",
        "0.14.0": "08d38a954a90ad6e",
        "0.15.3": "08d38a954a90ad6e",
        "0.16.1": "08d38a954a90ad6e",
        "0.17.1": "08d38a954a90ad6e",
        "0.18.2": "08d38a954a90ad6e",
        "0.19.2": "08d38a954a90ad6e",
    },
)

@dataclass(frozen=True)
class OverwriteFlagTarget:
    """Undo ``statement`` (``param.overwrite_main_grad = True``) of ``owner.attribute`` where it
    is wrong: after each call, reset the flag of every parameter of the ``params`` argument whose
    ``main_grad`` is Megatron-FSDP's persistent gradient buffer.

    Megatron-FSDP sets the flag on every parameter it unshards; Transformer Engine's linear
    layers read it in forward and then overwrite ``main_grad`` in backward instead of adding to
    it. Over a persistent buffer (``dispatcher.main_grad_is_persistent``: ``no_shard``/``optim``,
    or any strategy on one data-parallel rank) that keeps only the last micro-batch.
    """

    name: str
    distribution: str
    module: str
    owner: str
    attribute: str
    statement: str
    fingerprints: Mapping[str, str]  # release -> fingerprint of the unpatched method

    def patch(self, module: types.ModuleType, version: str | None, strict: bool) -> tuple[TargetStatus, Undo]:
        from . import config
        from .callsite import CallSiteError, analyse_statement

        def status(state: str, reason: str, fp: str | None = None) -> TargetStatus:
            return TargetStatus(self.name, self.module, state, reason, version, fp)

        where = f"{self.owner}.{self.attribute}"
        if not config.load().te_overwrite:
            return status(OFF, f"GEMM_PATCH_TE_OVERWRITE=0: `{self.statement}` of {where} left as "
                               "it is (TE layers overwrite a persistent main_grad)"), Undo()
        try:
            analysed = analyse_statement(module, self.owner, self.attribute, self.statement)
        except CallSiteError as exc:
            return status(SKIPPED, str(exc)), Undo()
        if analysed is None or not isinstance(vars(module).get(self.owner), type) \
                or self.attribute not in vars(vars(module)[self.owner]):
            return status(NOT_APPLICABLE, f"{module.__name__} has no {where}"), Undo()
        fp = analysed.fingerprint
        if not analysed.matches:
            return status(NOT_APPLICABLE, f"no `{self.statement}` in {where}", fp), Undo()
        state, reason = judge(self.name, self.fingerprints, version, fp, where,
                              f"`{self.statement}`", strict, self.distribution)
        owner = getattr(module, self.owner)
        original = vars(owner)[self.attribute]
        undo = Undo()
        undo.set(owner, self.attribute, PatchedOverwriteFlag(original, self.name))
        return status(state, reason, fp), undo


def _params_argument(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """The ``params`` argument (first after self), as a list where it was a one-shot iterator
    (the original walks it twice, and so does the reset)."""
    if args:
        params, rest = args[0], args[1:]
        if iter(params) is params:
            params = list(params)
        return params, (params, *rest), kwargs
    params = kwargs.get("params", ())
    if iter(params) is params:
        params = list(params)
        kwargs = {**kwargs, "params": params}
    return params, args, kwargs


class PatchedOverwriteFlag(wrapt.FunctionWrapper):
    """The installed object: a wrapt FunctionWrapper around the original (``__wrapped__`` is
    it). A call runs the original, then sets ``overwrite_main_grad = False`` on each parameter
    of ``params`` that has it set and whose main_grad is the persistent buffer; parameters with
    fresh per-backward buckets keep the original's True. ``resets`` counts the flags reset."""

    def __init__(self, original: Any, target: str) -> None:
        super().__init__(original, self._reset_after)
        self._self_gemm_patch_target = target
        self._self_resets = 0

    @property
    def resets(self) -> int:
        return self._self_resets

    def _reset_after(self, wrapped, instance, args, kwargs):
        from . import dispatcher

        params, args, kwargs = _params_argument(args, kwargs)
        result = wrapped(*args, **kwargs)
        for param in params:
            if getattr(param, "overwrite_main_grad", False) and dispatcher.main_grad_is_persistent(param):
                param.overwrite_main_grad = False
                self._self_resets += 1
        return result


_FSDP_TE_OVERWRITE_STATEMENT = "param.overwrite_main_grad = True"

FSDP_TE_OVERWRITE = OverwriteFlagTarget(
    name="fsdp-te-overwrite",
    distribution="megatron-core",
    module="megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
    owner="MegatronFSDP",
    attribute="all_gather_and_wait_parameters_ready",
    statement=_FSDP_TE_OVERWRITE_STATEMENT,
    fingerprints={
        # 0.13.1 has no such module (custom_fsdp sets no flag), 0.14.0 no such statement:
        # not applicable, nothing to record.
        "0.15.3": "cc3e6cbc490ab4f5",
        "0.16.1": "3c8b4af212ce4004",  # + the bwd argument
        "0.17.1": "3c8b4af212ce4004",
        "0.18.2": "3c8b4af212ce4004",
        "0.19.2": "3c8b4af212ce4004",
    },
)

# The same class shipped on its own (PyPI megatron-fsdp, imported as ``megatron_fsdp``); its
# releases are keyed by megatron-fsdp's version. Checked against the PyPI wheels.
MFSDP_TE_OVERWRITE = OverwriteFlagTarget(
    name="mfsdp-te-overwrite",
    distribution="megatron-fsdp",
    module="megatron_fsdp.megatron_fsdp",
    owner="MegatronFSDP",
    attribute="all_gather_and_wait_parameters_ready",
    statement=_FSDP_TE_OVERWRITE_STATEMENT,
    fingerprints={
        "0.2.3": "cc3e6cbc490ab4f5",  # = megatron-core 0.15.3's copy
        "0.3.1": "3c8b4af212ce4004",
        "0.4.0": "3c8b4af212ce4004",
        "0.5.1": "3c8b4af212ce4004",
        "0.6.1": "3c8b4af212ce4004",
    },
)

OVERWRITE_TARGETS = (FSDP_TE_OVERWRITE, MFSDP_TE_OVERWRITE)

TARGETS: tuple[CallSiteTarget | ApexWgradTarget | OverwriteFlagTarget, ...] = (
    FSDP_WGRAD, APEX_WGRAD, FSDP_TE_OVERWRITE, MFSDP_TE_OVERWRITE)

# status()'s one word on apex (JSON "apex"), and what it means (text and summary line).
APEX_WORDS = {
    "real": "apex's fused_weight_gradient_mlp_cuda is real and used untouched",
    "provided": "provided by gemm_patch (apex's fused_weight_gradient_mlp_cuda is missing)",
    "off": "not provided (GEMM_PATCH_APEX=0, or gemm_patch reverted or not applied)",
    "missing": "missing and not provided (see the apex-wgrad target)",
    "unknown": "not checked yet (megatron-core's layers module not imported)",
}


def apex_word(st: TargetStatus | None, enabled: bool) -> str:
    """``real``, ``provided``, ``off``, ``missing`` or ``unknown``, from the apex-wgrad state."""
    if st is None or st.state == PENDING:
        return "off" if not enabled else "unknown"
    if st.state == APEX_REAL:
        return "real"
    if st.state in (VERIFIED, UNVERIFIED):
        return "provided"
    if st.state == OFF or not enabled:
        return "off"
    return "missing"



def apex_summary(st: TargetStatus) -> str:
    """The apex-wgrad part of the once-per-process summary line."""
    word = apex_word(st, enabled=st.state != OFF)
    if word == "provided":
        return f"{st.name} provided (apex missing; {st.state})"
    if word == "real":
        return f"{st.name} idle (apex real)"
    if word == "off":
        return f"{st.name} off (GEMM_PATCH_APEX=0)"
    return f"{st.name} {st.state} (apex missing, not provided)"
