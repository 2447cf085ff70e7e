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
