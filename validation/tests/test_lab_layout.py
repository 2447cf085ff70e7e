"""The lab (validation/, benchmarks/) apart from the product: its modules import each other and
gemm_patch as packages (run as ``python -m validation.x.y`` / ``python -m benchmarks.x`` from the
repository root), never by editing ``sys.path``; no two of its modules import each other, at
any depth; the tests of its scripts sit beside them; its raw log archives stay under a stated
budget (the records the docs quote stay in the tree, the logs behind them may leave it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAB = ("validation", "benchmarks")
# Raw log archives committed under the lab (tar.gz of process logs, gzip'd concatenated logs).
LOG_ARCHIVE_BUDGET = 3 << 19  # bytes (1.5 MiB), all of them together


def lab_files() -> list[Path]:
    """The lab's own modules: not what its ignored scratch folders (``_kit``, ``_upstream``) hold."""
    return sorted(p for folder in LAB for p in (ROOT / folder).rglob("*.py")
                  if not any(part.startswith("_") and part != "__init__.py" for part in p.relative_to(ROOT).parts))


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imported(path: Path) -> set[str]:
    """The lab modules ``path`` imports, anywhere in it (a function's own import too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    # a plain name of a lab module (what a sys.path edit makes importable) counts as that module
    plain = {p.stem: module_name(p) for p in lab_files() if p.stem != "__init__"}
    return {name if name.split(".")[0] in LAB else plain[name] for name in names
            if name.split(".")[0] in LAB or name in plain}


def test_no_lab_module_edits_sys_path():
    edits = []
    for path in lab_files():
        for node in ast.walk(ast.parse(path.read_text())):
            target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else \
                node.targets[0] if isinstance(node, ast.Assign) else None
            if isinstance(target, ast.Subscript):
                target = target.value
            if target is not None and ast.unparse(target) == "sys.path":
                edits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not edits, f"sys.path edited (import the lab as packages instead): {edits}"


def test_no_import_circle_in_the_lab():
    modules = {module_name(p): p for p in lab_files()}
    graph = {name: {m for m in imported(path) if m in modules and m != name} for name, path in modules.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            name = todo.pop()
            if name == goal:
                return True
            if name not in seen:
                seen.add(name)
                todo.extend(graph[name])
        return False

    circles = sorted({" <-> ".join(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a)})
    assert not circles, circles


def test_the_tests_of_lab_scripts_sit_beside_them():
    in_product_tests = [p.name for p in (ROOT / "tests").glob("test_*.py")
                        if any(m.split(".")[0] in LAB for m in imported(p))]
    assert not in_product_tests, f"tests of lab scripts under tests/: {in_product_tests}"


def test_raw_log_archives_stay_under_budget():
    archives = [p for folder in LAB for p in (ROOT / folder).rglob("*.gz")
                if "logs" in p.name and not p.name.endswith(".json.gz")]
    total = sum(p.stat().st_size for p in archives)
    assert archives and total <= LOG_ARCHIVE_BUDGET, (
        f"{total} bytes of log archives over {LOG_ARCHIVE_BUDGET}: "
        + ", ".join(f"{p.relative_to(ROOT)} {p.stat().st_size}" for p in archives))


def test_every_gemm_patch_name_the_lab_imports_exists():
    """A module of gemm_patch the lab imports (a function's own import too, which runs only on the GPU
    machine) exists, with the names taken from it: a package move leaves no stale import behind."""
    import importlib

    def exists(module: str, name: str | None = None) -> bool:
        try:
            found = importlib.import_module(module)
            return name is None or hasattr(found, name) or bool(importlib.import_module(f"{module}.{name}"))
        except ImportError:
            return False

    wanted = []
    for path in lab_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                wanted += [(path, node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                wanted += [(path, alias.name, None) for alias in node.names]
    missing = [f"{path.relative_to(ROOT)}: {module}{'.' + name if name else ''}" for path, module, name in wanted
               if module.split(".")[0] == "gemm_patch" and not exists(module, name)]
    assert not missing, missing
