"""Transformer Engine's own files for the te-dummy-wgrad tests, on a machine without TE.

TE's Python package cannot be imported without its CUDA library, so the modules the target
reads are rebuilt from each release's real files (``compat/te_sources.py`` fetches them into
``compat/.cache/te-X/``): ``base`` holds ``get_dummy_wgrad`` compiled from ``base.py`` itself
(the code object the import would make, with a stand-in ``torch`` whose ``empty`` ignores the
CUDA device), and ``linear`` / ``layernorm_linear`` bind that very function, as their
``from .base import get_dummy_wgrad`` does. Each module's ``__file__`` is the real file, so the
target parses TE's real source.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "compat" / ".cache"
MODULE_DIR = Path("transformer_engine") / "pytorch" / "module"


def te_root(version: str) -> Path:
    return CACHE / f"te-{version}"


class _CpuTorch:
    """What TE's ``get_dummy_wgrad`` calls on ``torch``, on the CPU."""

    def __init__(self, torch) -> None:
        self._torch = torch

    def empty(self, shape, dtype=None, device=None, requires_grad=False):
        return self._torch.empty(shape, dtype=dtype, requires_grad=requires_grad)


def install_te_modules(version: str, setitem) -> dict[str, types.ModuleType]:
    """Put TE ``version``'s three modules (and their packages) into sys.modules through
    ``setitem`` (pytest's ``monkeypatch.setitem``); return them by short name."""
    import torch

    folder = te_root(version) / MODULE_DIR
    modules: dict[str, types.ModuleType] = {}
    for package in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.module"):
        setitem(sys.modules, package, types.ModuleType(package))
    base = types.ModuleType("transformer_engine.pytorch.module.base")
    base.__file__ = str(folder / "base.py")
    code = compile((folder / "base.py").read_text(), base.__file__, "exec", dont_inherit=True)
    function_code = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == "get_dummy_wgrad")
    base.torch = _CpuTorch(torch)
    base._dummy_wgrads = {}
    funcdef = next(n for n in ast.parse((folder / "base.py").read_text()).body
                   if isinstance(n, ast.FunctionDef) and n.name == "get_dummy_wgrad")
    defaults = tuple(ast.literal_eval(d) for d in funcdef.args.defaults)  # what ``def`` would bind
    base.get_dummy_wgrad = types.FunctionType(function_code, base.__dict__, "get_dummy_wgrad", defaults)
    setitem(sys.modules, base.__name__, base)
    modules["base"] = base
    for short in ("linear", "layernorm_linear"):
        caller = types.ModuleType(f"transformer_engine.pytorch.module.{short}")
        caller.__file__ = str(folder / f"{short}.py")
        caller.get_dummy_wgrad = base.get_dummy_wgrad
        setitem(sys.modules, caller.__name__, caller)
        modules[short] = caller
    modules["package"] = sys.modules["transformer_engine.pytorch"]
    return modules
