"""Synthetic target modules for the gate tests: real modules loaded from source written to a
temporary file, so ``inspect.getsource`` (which the gates read) works on them."""

from __future__ import annotations

import importlib.util
import textwrap
import types
from pathlib import Path


def load_source(directory: Path, source: str, name: str) -> types.ModuleType:
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_edited_copy(directory: Path, module: types.ModuleType, old: str, new: str,
                     append: str = "") -> types.ModuleType:
    """A real module's own source with ``old`` (which must occur) replaced by ``new``, run as a
    sibling module of its package (its relative imports resolve as the original's), kept in
    ``sys.modules`` under its own name."""
    import inspect
    import sys

    source = inspect.getsource(module)
    assert old in source, f"{old!r} not in {module.__name__}"
    package, _, short = module.__name__.rpartition(".")
    name = f"{package}._edited_{short}"
    path = directory / f"_edited_{short}.py"
    path.write_text(source.replace(old, new) + append)
    spec = importlib.util.spec_from_file_location(name, path)
    edited = importlib.util.module_from_spec(spec)
    sys.modules[name] = edited
    spec.loader.exec_module(edited)
    return edited
