"""What gets patched: each target is data (where, what call, which versions were verified)
plus ``patch``, which returns a status and the exact undo list.

Adding a megatron-core release is one line in a ``fingerprints`` table (get the value with
``python compat/fingerprint.py``) and one line in ``compat/matrix.toml``.
"""

from __future__ import annotations

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
    """Attribute assignments to reverse, newest last: (owner, attribute, original, existed)."""

    steps: list[tuple[Any, str, Any, bool]] = field(default_factory=list)

    def set(self, owner: Any, attribute: str, value: Any) -> None:
        existed = attribute in vars(owner)
        self.steps.append((owner, attribute, vars(owner).get(attribute), existed))
        setattr(owner, attribute, value)

    def run(self) -> None:
        for owner, attribute, original, existed in reversed(self.steps):
            if existed:
                setattr(owner, attribute, original)
            elif attribute in vars(owner):
                delattr(owner, attribute)
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

    def patch(self, module: types.ModuleType, version: str | None, strict: bool) -> tuple[TargetStatus, Undo]:
        from . import dispatcher
        from .callsite import CallSiteError, analyse, build_twin

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
        known = self.fingerprints.get(public_version(version))
        if known == fp:
            state, reason = VERIFIED, f"{where}: call site matches release {version}"
        else:
            state = UNVERIFIED
            reason = (f"{where}: megatron-core {version} is not a verified release" if known is None
                      else f"{where}: source differs from release {version} (fingerprint {fp}, "
                           f"release {known})") + "; the call site still matches"
            if strict:
                raise UnverifiedRefused(f"{self.name}: {reason}; refused because GEMM_PATCH_STRICT=1")
        try:
            twin = build_twin(analysed, f"{self.owner}.{self.attribute}",
                              getattr(dispatcher, self.replacement),
                              extra_keywords=dict(self.extra_keywords))
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
    fingerprints={
        # 0.13.1 has no such call ("9d4c7c715e880205"): not applicable, nothing to record.
        "0.14.0": "338662a6449c37a5",
        "0.15.3": "338662a6449c37a5",
        "0.16.1": "338662a6449c37a5",
        "0.17.1": "338662a6449c37a5",
        "0.18.2": "f4c659c5c28f0101",  # the torch.matmul left in the no-TE else-branch
        "0.19.2": "582d17875a6239b1",
    },
)

TARGETS: tuple[CallSiteTarget, ...] = (FSDP_WGRAD,)
