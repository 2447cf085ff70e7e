"""nemo-fsdp-gaf (opt-in): NeMo 2.x keeps the user's ``gradient_accumulation_fusion=True`` on
Megatron-FSDP where gemm_patch makes megatron-core's fused weight-gradient path correct.

NeMo 2.5-2.7 (``nemo.lightning``; nemo-toolkit 3.0 has none) turns fusion off on its
Megatron-FSDP branch of ``MegatronParallel.init_ddp`` (``nemo/lightning/megatron_parallel.py``)::

    if getattr(module.config, "gradient_accumulation_fusion", True):
        setattr(module.config, "gradient_accumulation_fusion", False)
        logging.warning("Setting module.config.gradient_accumulation_fusion to False for MCore FSDP.")

The patch is a twin of ``init_ddp`` compiled from NeMo's own source (its globals, file name and
line numbers) in which that ``if`` asks one more question, ``<NeMo's test> and
_gemm_patch_nemo_gaf(module.config)``: the answer is False (NeMo keeps the setting, and says
nothing) only when the config asks for fusion and, at that moment, gemm_patch's targets for the
fused path are in place for the megatron-core that is imported: fsdp-wgrad verified or
compatible, apex-wgrad verified or compatible (apex's extension provided) or ``apex real``, and
fsdp-te-overwrite verified or compatible (or not applicable on a verified release that has no
such flag, megatron-core 0.14). In every other case NeMo's own code runs as before: its write,
its warning. Nothing else in ``init_ddp`` changes.

What NeMo's write changes: it comes after the model is built (Lightning's ``configure_model``
runs before the strategy's ``setup`` reaches ``init_ddp``), and megatron-core's layers read the
flag when they are built (``ColumnParallelLinear``/``RowParallelLinear`` keep a copy, TE layers get
``fuse_wgrad_accumulation``), so their backward keeps the user's setting either way. What reads
the config later is what the write turns off: megatron-core 0.17+'s Megatron-FSDP adapter
(which asserts Transformer Engine >= 2.10 when fusion is on), the deferred embedding wgrad
(``megatron/core/utils.py``) and CUDA graphs. Kept, the config again says what the layers do.
"""

from __future__ import annotations

import ast
import copy
import logging
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..engine import detection, report
from ..engine.callsite import (
    AnalysedFunction,
    build_edited_twin,
    canonical_dump,
    check_live_is_source,
    fingerprint,
    parse_method,
)
from ..engine.config import Config
from ..engine.target import (
    COMPATIBLE,
    DEFAULTS,
    NOT_APPLICABLE,
    VERIFIED,
    Inspection,
    MethodTarget,
    PatchedTwin,
    Undo,
    current_states,
)
from . import apex_wgrad, fsdp_wgrad, te_overwrite

TEST = 'getattr(module.config, "gradient_accumulation_fusion", True)'
WRITE = 'setattr(module.config, "gradient_accumulation_fusion", False)'
CELL = "_gemm_patch_nemo_gaf"
PROVEN = (VERIFIED, COMPATIBLE)  # "forced" (unknown megatron code) does not count


def fused_path_ready(states: Mapping[str, str]) -> tuple[bool, str]:
    """Whether gemm_patch's targets make the Megatron-FSDP fused path correct, from their
    states (target name -> state), and what was found."""
    names = (fsdp_wgrad.TARGET.name, apex_wgrad.TARGET.name, te_overwrite.TARGET.name)
    wgrad, apex, te = (states.get(name, "absent") for name in names)
    missing = []
    if wgrad not in PROVEN:
        missing.append(f"{names[0]} is {wgrad}")
    if apex not in PROVEN and apex != apex_wgrad.APEX_REAL:
        missing.append(f"{names[1]} is {apex}")
    # Not applicable on a release whose fsdp-wgrad is verified: megatron-core 0.14, which sets no
    # overwrite flag (every verified release from 0.15 on records fsdp-te-overwrite).
    if te not in PROVEN and not (te == NOT_APPLICABLE and wgrad == VERIFIED):
        missing.append(f"{names[2]} is {te}")
    found = ", ".join(f"{name} {state}" for name, state in zip(names, (wgrad, apex, te), strict=True))
    return not missing, "; ".join(missing) if missing else found


def _live_states() -> dict[str, str]:
    return dict(current_states())


_said: set[str] = set()


def _say(message: str) -> None:
    if message not in _said:
        _said.add(message)
        report.emit(logging.INFO if detection.process_rank() == 0 else logging.DEBUG, message)


def nemo_turns_fusion_off(config: Any) -> bool:
    """The question added to NeMo's ``if``: True lets NeMo turn fusion off (its own behaviour),
    False keeps the user's setting. Asked only where NeMo's own test found fusion on (or no
    attribute at all)."""
    if not getattr(config, "gradient_accumulation_fusion", False):
        return True  # no such attribute: NeMo's setattr creates it, as before
    try:
        ready, why = fused_path_ready(_live_states())
    except Exception as exc:  # a fault here must not break NeMo's setup: NeMo decides
        ready, why = False, f"gemm_patch could not read its targets ({type(exc).__name__}: {exc})"
    if ready:
        _say(f"nemo-fsdp-gaf: NeMo keeps gradient_accumulation_fusion=True with Megatron-FSDP ({why})")
        return False
    _say(f"nemo-fsdp-gaf: NeMo turns gradient_accumulation_fusion off with Megatron-FSDP as usual: {why}")
    return True


def _decision_ifs(funcdef: ast.AST) -> list[ast.If]:
    """Each ``if <TEST>:`` whose body starts with ``<WRITE>`` (compared as ASTs)."""
    test = canonical_dump(ast.parse(TEST, mode="eval").body)
    write = canonical_dump(ast.parse(WRITE).body[0])
    return [node for node in ast.walk(funcdef)
            if isinstance(node, ast.If) and canonical_dump(node.test) == test
            and node.body and canonical_dump(node.body[0]) == write]


def _ask_gemm_patch_too(funcdef: ast.FunctionDef) -> None:
    (node,) = _decision_ifs(funcdef)
    config = copy.deepcopy(node.test.args[0])  # module.config
    question = ast.copy_location(ast.Call(func=ast.Name(id=CELL, ctx=ast.Load()), args=[config], keywords=[]),
                                 node.test)
    node.test = ast.copy_location(ast.BoolOp(op=ast.And(), values=[node.test, question]), node.test)


@dataclass(frozen=True, kw_only=True, eq=False)
class NemoFusionTarget(MethodTarget):
    def inspect(self, module: types.ModuleType, cfg: Config = DEFAULTS) -> Inspection:
        funcdef = parse_method(module, self.owner, self.attribute)
        if funcdef is None or self.live_object(module) is None:
            return Inspection(None, False, f"{module.__name__} has no {self.where}")
        fp = fingerprint(funcdef)
        ifs = _decision_ifs(funcdef)
        if len(ifs) != 1:
            return Inspection(fp, False, f"{len(ifs)} `if {TEST}: {WRITE}` in {self.where}, not one")
        check_live_is_source(module, self.owner, self.attribute)
        twin = build_edited_twin(AnalysedFunction(module, funcdef, fp, ifs), self.where, _ask_gemm_patch_too,
                                 {CELL: nemo_turns_fusion_off})
        return Inspection(fp, True, f"{self.where}'s Megatron-FSDP fusion switch-off", twin)

    def install(self, module: types.ModuleType, found: Inspection, undo: Undo, cfg: Config) -> str | None:
        self.replace(module, undo, PatchedTwin(self.live_object(module), found.payload))


TARGET = NemoFusionTarget(
    name="nemo-fsdp-gaf",
    distribution="nemo-toolkit",
    module="nemo.lightning.megatron_parallel",
    default_on=False,  # opt-in: GEMM_PATCH_NEMO_FSDP_GAF=1
    relies_on="init_ddp",
    owner="MegatronParallel",
    attribute="init_ddp",
)
