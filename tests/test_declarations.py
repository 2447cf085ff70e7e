"""Everything declared once and used in several places agrees: a target, a backend or a start-up
trigger declared in one place and missing from another fails here.

- targets: ``gemm_patch.targets.REGISTRY`` is the declaration; the release data
  (tests/test_release_data.py), the versions reported (``detection.DISTRIBUTIONS``), the
  start-up hook's ``TRIGGERS`` (a literal, so that a process never importing megatron never
  imports gemm_patch), the tests' ``proves`` markers, the docs' table of target modules and
  their switches follow it;
- backends: ``gemm.BACKEND_ORDER`` names them; ``backends.all_backends()``,
  ``dispatcher.DEFAULT_ORDER`` and ``config.BACKEND_CHOICES`` follow it;
- the pytest markers the matrix and compat/adopt.py read are registered in pyproject.toml;
- docs/development.md's recipes "Add a target" and "Add a backend" name files that exist.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from gemm_patch.engine import config, detection
from gemm_patch.targets import REGISTRY

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "compat"))
import matrix_quick  # noqa: E402

MEGATRON = ("megatron-core", "megatron-fsdp")  # the components with a test folder in the matrix


def test_target_names_are_unique():
    names = [t.name for t in REGISTRY]
    assert len(names) == len(set(names)), names


def test_every_target_distribution_has_its_version_reported():
    assert {t.distribution for t in REGISTRY} <= set(detection.DISTRIBUTIONS)


def test_triggers_are_the_top_level_packages_of_the_registered_targets():
    bootstrap = str(ROOT / "gemm_patch" / "bootstrap")
    sys.path.insert(0, bootstrap)
    try:
        import _gemm_patch_startup
    finally:
        sys.path.remove(bootstrap)
    assert set(_gemm_patch_startup.TRIGGERS) == {t.module.split(".")[0] for t in REGISTRY}
    assert len(_gemm_patch_startup.TRIGGERS) == len(set(_gemm_patch_startup.TRIGGERS))


def test_backends_are_registered_once():
    pytest.importorskip("torch")
    from gemm_patch import gemm
    from gemm_patch.gemm import backends, dispatcher

    defined = {obj.name for obj in vars(backends).values()
               if isinstance(obj, type) and issubclass(obj, backends.Backend) and obj is not backends.Backend}
    assert set(gemm.BACKEND_ORDER) == defined, "every backend class is named in gemm.BACKEND_ORDER"
    assert tuple(backends.all_backends()) == gemm.BACKEND_ORDER == dispatcher.DEFAULT_ORDER
    assert config.BACKEND_CHOICES == ("auto", *gemm.BACKEND_ORDER)
    assert dispatcher.WgradDispatcher().order == gemm.BACKEND_ORDER


def _proves_markers() -> dict[str, set[str]]:
    """Target name -> the test files whose ``proves`` marker names it, read from the source (the
    contract's tests name their target's from the registry: tests/contract.py)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == matrix_quick.PROVES):
                for arg in node.args:
                    assert isinstance(arg, ast.Constant), f"{path.name}: proves() takes target names"
                    found.setdefault(arg.value, set()).add(path.name)
    return found


def test_proves_markers_name_registered_targets_and_every_megatron_target_has_one():
    found = _proves_markers()
    names = {t.name for t in REGISTRY}
    assert set(found) <= names, f"unknown targets in proves markers: {sorted(set(found) - names)}"
    unproven = [t.name for t in REGISTRY if t.distribution in MEGATRON and t.name not in found]
    assert not unproven, f"no test is marked proves({unproven[0]!r}) beside the contract"


def test_the_markers_are_registered():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {line.split(":")[0].split("(")[0] for line in ini["markers"]}
    assert {matrix_quick.PROVES, matrix_quick.COMMON_MACHINERY, matrix_quick.SWEEP} <= registered


def test_the_docs_name_every_target_and_its_switch():
    development = (ROOT / "docs" / "development.md").read_text()
    configuration = (ROOT / "docs" / "configuration.md").read_text()
    for target in REGISTRY:
        assert f"`{target.name}`" in development, f"docs/development.md's table of targets lacks {target.name}"
        for variable in (target.switch_variable, *target.options):
            assert variable in configuration, f"docs/configuration.md lacks {variable} ({target.name})"


@pytest.mark.parametrize("recipe", ["Add a target", "Add a backend"])
def test_the_recipes_name_real_files(recipe):
    text = (ROOT / "docs" / "development.md").read_text()
    assert f"## {recipe}\n" in text
    section = text.split(f"## {recipe}\n", 1)[1].split("\n## ", 1)[0]
    paths = [p for p in re.findall(r"`([\w./<>-]+)`", section) if "/" in p]
    assert len(paths) >= 4, paths
    for path in paths:
        # A placeholder (<fix>.py) names a file to create: its folder must exist.
        existing = ROOT / (path.rsplit("/", 1)[0] if "<" in path else path)
        assert existing.exists(), f"docs/development.md, {recipe}: {path} does not exist"
