"""apex-wgrad: provide apex's compiled ``fused_weight_gradient_mlp_cuda`` where it did not import.

megatron-core refuses ``gradient_accumulation_fusion=True`` without it, even for Megatron-FSDP
parameters that never call it. The stand-in is a plain module whose two functions mean what
apex's do, ``main_grad += grad_output^T @ total_input`` with fp32 accumulation, through the
WgradDispatcher. It goes into ``sys.modules`` (for by-name imports such as the deferred
embedding wgrad in ``megatron/core/utils.py``) and into the layers module's globals, and the
availability flag becomes True. A real apex is never shadowed, unless asked:

``GEMM_PATCH_APEX=replace`` routes apex's two wgrad functions through the dispatcher even where
apex's extension imports (a real apex that fails, e.g. ``CUBLAS_STATUS_NOT_INITIALIZED`` on
GB200): the stand-in goes over the real extension in the layers module and in ``sys.modules``,
under the same fingerprint gate, and revert puts the real one back. ``1`` (the default) provides
it only where apex is missing; ``0`` turns the target off.
"""

from __future__ import annotations

import gc
import importlib.machinery
import sys
import types
from dataclasses import dataclass
from typing import Any

from ..engine.config import Config
from ..engine.target import (
    DEFAULTS,
    NOT_APPLICABLE,
    OFF,
    PATCHED_STATES,
    PENDING,
    SKIPPED,
    Inspection,
    Target,
    TargetStatus,
    Undo,
    instances_of,
)
from .apex_analysis import find_apex_usage

EXTENSION = "fused_weight_gradient_mlp_cuda"
APEX_REAL = "apex real"  # apex's own extension imported: nothing to provide
REPLACE = "replace"  # GEMM_PATCH_APEX=replace: the stand-in goes over a real apex too
REPLACED_REAL = "apex real, replaced"  # how the reason starts when it did
_MARKER = "__gemm_patch_stand_in__"


def apex_wgrad(total_input: Any, grad_output: Any, main_grad: Any) -> None:
    """apex's ``wgrad_gemm_accum_fp32/fp16(total_input, grad_output, main_grad)``."""
    from ..gemm.active import active_dispatcher

    # apex folds leading dimensions into the token dimension ([s, b, h] -> [s*b, h]).
    total_input = total_input.reshape(-1, total_input.shape[-1])
    grad_output = grad_output.reshape(-1, grad_output.shape[-1])
    active_dispatcher().gemm(grad_output.t(), total_input, main_grad, accumulate=True)


def _build_stand_in() -> types.ModuleType:
    module = types.ModuleType(EXTENSION, f"gemm_patch's stand-in for apex's {EXTENSION} "
                                         "(apex's extension is not importable here).")
    # A spec makes importlib.util.find_spec(EXTENSION) answer instead of raising ValueError
    # for a sys.modules entry whose __spec__ is None.
    module.__spec__ = importlib.machinery.ModuleSpec(EXTENSION, loader=None, origin="gemm_patch")
    module.wgrad_gemm_accum_fp32 = apex_wgrad  # fp32 main_grad
    module.wgrad_gemm_accum_fp16 = apex_wgrad  # 16-bit main_grad, the operands' dtype
    setattr(module, _MARKER, True)
    return module


# One object per process, so identity checks hold across apply/revert cycles.
STAND_IN: types.ModuleType = _build_stand_in()


def is_stand_in(obj: object) -> bool:
    """True for this stand-in, and for one built by another copy of gemm_patch."""
    return isinstance(obj, types.ModuleType) and getattr(obj, _MARKER, False) is True


# status()'s one word on apex (JSON "apex"), and what it means.
APEX_WORDS = {
    "real": "apex's fused_weight_gradient_mlp_cuda is real and used untouched",
    "replaced": "apex's fused_weight_gradient_mlp_cuda is real but replaced by gemm_patch's (GEMM_PATCH_APEX=replace)",
    "provided": "apex's fused_weight_gradient_mlp_cuda is missing; gemm_patch stands in for it",
    "off": "not provided (GEMM_PATCH_APEX=0, or gemm_patch reverted or not applied)",
    "missing": "missing and not provided (see the apex-wgrad target)",
    "unknown": "not checked yet (megatron-core's layers module not imported)",
}


def apex_word(st: TargetStatus | None) -> str:
    """``real``, ``replaced``, ``provided``, ``off``, ``missing`` or ``unknown``, from the
    apex-wgrad state."""
    if st is None or st.state == PENDING:
        return "unknown"
    if st.state == APEX_REAL:
        return "real"
    if st.state in PATCHED_STATES:
        return "replaced" if st.reason.startswith(REPLACED_REAL) else "provided"
    if st.state == OFF:
        return "off"
    if st.state == NOT_APPLICABLE and st.version is None:
        return "unknown"  # megatron-core not installed
    return "missing"


# The modules the stand-in was installed on in this process (layers built there may rely on it).
_PROVIDED: set[str] = set()
# The layers whose constructor refuses gradient-accumulation fusion without the extension.
FUSED_LAYERS = ("ColumnParallelLinear", "RowParallelLinear")


def _takes_apex_path(layer: Any) -> bool:
    """Whether ``layer``'s backward calls apex's wgrad: gradient-accumulation fusion on, for a
    weight that is not Megatron-FSDP's (which takes the other branch)."""
    weight = vars(layer).get("_parameters", {}).get("weight")
    return (vars(layer).get("gradient_accumulation_fusion") is True and weight is not None
            and not getattr(weight, "__fsdp_param__", False))


def _real(obj: object) -> bool:
    return obj is not None and not is_stand_in(obj)


@dataclass(frozen=True, kw_only=True, eq=False)
class ApexWgradTarget(Target):
    extension: str
    flag: str
    calls: tuple[str, ...]

    def replacing(self, cfg: Config) -> bool:
        """GEMM_PATCH_APEX=replace: the stand-in goes over a real extension too."""
        return cfg.choice(self.switch_variable) == REPLACE

    def precheck(self, module: types.ModuleType, cfg: Config) -> tuple[str, str] | None:
        if self.replacing(cfg):
            return None  # a real extension, wherever it sits, is replaced
        ext, where = self.extension, module.__name__
        if _real(vars(module).get(ext)):
            return APEX_REAL, f"apex's {ext} was imported by {where}; used untouched"
        if _real(sys.modules.get(ext)):
            return SKIPPED, (f"{ext} was imported after {where} (which found none); left alone: a real "
                             "extension is never shadowed (GEMM_PATCH_APEX=replace replaces it)")
        return None

    def inspect(self, module: types.ModuleType, cfg: Config = DEFAULTS) -> Inspection:
        usage = find_apex_usage(module, self.extension, self.flag, self.calls)
        where = module.__name__
        if usage.guarded_import is None or usage.flag_default is None:
            return Inspection(usage.fingerprint, False, f"{where} has no guarded `import {self.extension}` "
                                                        f"setting {self.flag}")
        if not usage.calls:
            return Inspection(usage.fingerprint, False,
                              f"{where} calls none of {self.extension}.{{{', '.join(self.calls)}}}")
        functions = f"{self.extension}.{{{', '.join(usage.call_names)}}}"
        if self.replacing(cfg) and (_real(vars(module).get(self.extension)) or _real(sys.modules.get(self.extension))):
            replaced = f"{REPLACED_REAL}: {functions} routed through gemm_patch ({self.switch_variable}={REPLACE})"
            return Inspection(usage.fingerprint, True, replaced, usage)
        provided = f"apex missing: {functions} provided by gemm_patch"
        return Inspection(usage.fingerprint, True, provided, usage)

    def summary_part(self, st: TargetStatus) -> str:
        if st.state in PATCHED_STATES:
            if st.reason.startswith(REPLACED_REAL):
                return f"{st.name} replaced apex ({self.switch_variable}={REPLACE}; {st.state})"
            return f"{st.name} provided (apex missing; {st.state})"
        if st.state == APEX_REAL:
            return f"{st.name} idle (apex real)"
        return super().summary_part(st)

    def status_fields(self, st: TargetStatus | None) -> dict[str, tuple[str, str]]:
        word = apex_word(st)
        return {"apex": (word, APEX_WORDS[word])}

    without_it = ("their backward finds no fused_weight_gradient_mlp_cuda (NameError), as apex is missing; "
                  "gemm_patch.apply() again before it, or rebuild them with gradient_accumulation_fusion off")

    def left_without(self) -> list:
        # Only after the stand-in was megatron's (a layer cannot be built with fusion on and no
        # extension, so none exists otherwise), and only while no extension is there again.
        module = sys.modules.get(self.module)
        if module is None or not _PROVIDED or vars(module).get(self.extension) is not None:
            return []
        classes = {c for c in map(vars(module).get, FUSED_LAYERS) if isinstance(c, type)}
        if not any(map(_takes_apex_path, instances_of(classes))):
            return []
        gc.collect()  # a layer dropped by its user may wait in a cycle: only live ones are said
        return [layer for layer in instances_of(classes) if _takes_apex_path(layer)]

    def install(self, module: types.ModuleType, found: Inspection, undo: Undo, cfg: Config) -> str | None:
        _PROVIDED.add(module.__name__)
        undo.set_item(sys.modules, self.extension, STAND_IN)
        undo.set(module, self.extension, STAND_IN)
        undo.set(module, self.flag, True)


TARGET = ApexWgradTarget(
    name="apex-wgrad",
    distribution="megatron-core",
    module="megatron.core.tensor_parallel.layers",
    switch="GEMM_PATCH_APEX",
    switch_values=(REPLACE,),
    relies_on="apex usage",
    extra_states={APEX_REAL: "apex's own extension is imported and used untouched "
                             "(GEMM_PATCH_APEX=replace routes it through gemm_patch)"},
    extension=EXTENSION,
    flag="_grad_accum_fusion_available",
    calls=("wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16"),
)

