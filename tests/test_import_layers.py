"""No import climbs from a lower layer of gemm_patch back up: the targets and the core modules the
patcher is built on never import the patcher or the command (what a target needs from the patcher
at run time is handed down: ``target.current_states``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gemm_patch"
UPPER = {"gemm_patch.engine.patcher", "gemm_patch.commands.cli", "gemm_patch.commands.doctor",
         "gemm_patch.commands.demo", "gemm_patch.commands.launcher"}
LOWER = [*(f"engine/{name}.py" for name in ("target", "callsite", "config", "detection", "report", "imports")),
         "gemm/dispatcher.py", "gemm/backends.py",
         *(f"targets/{p.name}" for p in sorted((PACKAGE / "targets").glob("*.py")))]


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved (``from .. import x``: the
    package's ``x``)."""
    package = "gemm_patch" + "".join(f".{part}" for part in path.parent.relative_to(PACKAGE).parts)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, (base, node.module)))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_lower_layers_never_import_the_patcher_or_the_command():
    climbing = {name: sorted(imported(PACKAGE / name) & UPPER) for name in LOWER}
    assert not {k: v for k, v in climbing.items() if v}, climbing


def test_the_check_sees_a_climbing_import(tmp_path):
    (tmp_path / "targets").mkdir()
    probe = PACKAGE / "targets" / "nemo_fsdp_gaf.py"
    assert "gemm_patch.targets" in {n.rsplit(".", 1)[0] for n in imported(probe)} or imported(probe)
    source = "from ..engine import detection, patcher\nfrom ..commands.cli import main\n"
    path = PACKAGE / "targets" / "_probe_climb.py"
    try:
        path.write_text(source)
        assert imported(path) & UPPER == {"gemm_patch.engine.patcher", "gemm_patch.commands.cli"}
    finally:
        path.unlink()
