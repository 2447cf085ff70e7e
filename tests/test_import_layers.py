"""gemm_patch's folders are its layers, and imports run one way: down. A module imports from
its own folder and from the layers below it, never from one above (what a lower layer needs
from a higher one at run time is handed down: the registry and version to the patcher, the
backend setting to the dispatcher, ``target.current_states`` to the targets)."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gemm_patch"
# Bottom to top (support: standard-library helpers every layer may use). "" is the package's
# own __init__.py (the public API and the switch of
# ``import gemm_patch``); commands and the start-up bootstrap stand on it, side by side.
LAYERS = (("support",), ("gemm",), ("engine",), ("upstream",), ("targets",), ("",), ("commands", "bootstrap"),
          ("__main__",))
RANK = {folder: rank for rank, folders in enumerate(LAYERS) for folder in folders}


def imported(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every gemm_patch module ``path`` imports, relative imports resolved (``from .. import x``:
    the package's ``x``)."""
    here = "gemm_patch" + "".join(f".{part}" for part in path.parent.relative_to(package).parts)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, (base, node.module)))
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] == "gemm_patch"}


def layer(module: str) -> str:
    """The folder (layer) of a gemm_patch module or name; "" for the package itself and the
    names its __init__.py defines."""
    part = module.split(".")[1] if "." in module else ""
    return part if part in RANK else ""


def climbing(package: Path = PACKAGE) -> dict[str, list[str]]:
    """file -> the imports that reach a layer above its own, or sideways into another folder."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        own = relative.parts[0] if len(relative.parts) > 1 else relative.stem.replace("__init__", "")
        assert own in RANK, f"gemm_patch/{relative} is in no layer: place its folder in LAYERS"
        bad = sorted(name for name in imported(path, package)
                     if layer(name) != own and RANK[layer(name)] >= RANK[own])
        if bad:
            found[str(relative)] = bad
    return found


def test_imports_run_down_the_layers():
    assert not climbing(), climbing()


def test_the_package_root_holds_only_its_api_and_entry():
    assert {p.name for p in PACKAGE.glob("*.py")} == {"__init__.py", "__main__.py"}


def test_the_check_sees_a_climbing_import(tmp_path):
    copy = tmp_path / "gemm_patch"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "gemm" / "probe.py").write_text("from ..engine import config\n")
    (copy / "engine" / "probe.py").write_text("from .. import __version__\nfrom ..targets import REGISTRY\n")
    (copy / "targets" / "probe.py").write_text("def late():\n    from ..commands.cli import main\n")
    (copy / "commands" / "probe.py").write_text("import gemm_patch.bootstrap.sitecustomize\n")
    assert climbing(copy) == {
        "commands/probe.py": ["gemm_patch.bootstrap.sitecustomize"],
        "engine/probe.py": ["gemm_patch.__version__", "gemm_patch.targets.REGISTRY"],
        "gemm/probe.py": ["gemm_patch.engine.config"],
        "targets/probe.py": ["gemm_patch.commands.cli.main"],
    }

