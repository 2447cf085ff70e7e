"""pytest plugin of the version matrix (compat/matrix.py loads it with ``-p matrix_states``).

Before pytest loads a conftest or a test module, it does what a user's fresh process does: imports
gemm_patch, then each target's module, and reads the release's version and every target's state
(``read_states``), written as JSON to the file ``GEMM_PATCH_MATRIX_STATES`` names. Nothing of the
tests has run or been imported yet, so these are the states of a fresh import, read without a
process of their own; compat/matrix.py starts one (``PROBE``) only where the file is missing.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

STATES_ENV = "GEMM_PATCH_MATRIX_STATES"  # the file the states are written to
NAMES_ENV = "GEMM_PATCH_MATRIX_STATES_OF"  # "component:target,target,..." whose states are read

# The same, in a process of its own: python -c PROBE COMPONENT TARGET,TARGET,...
PROBE = ("import json, sys, matrix_states; "
         "print(json.dumps(matrix_states.read_states(sys.argv[1], sys.argv[2].split(','))))")


def read_states(component: str, names: list[str]) -> dict:
    """{"version": the component's installed version, "states": {target: state}} after importing
    gemm_patch, then the module of each target named."""
    import gemm_patch
    from gemm_patch.engine import detection
    from gemm_patch.targets import REGISTRY

    for target in REGISTRY:
        if target.name in names:
            try:
                importlib.import_module(target.module)
            except ImportError:
                pass
    return {"version": detection.distribution_version(component),
            "states": {t.name: t.state for t in gemm_patch.status().targets if t.name in names}}


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args) -> None:
    path, spec = os.environ.get(STATES_ENV), os.environ.get(NAMES_ENV)
    if not path or not spec:
        return
    component, _, names = spec.partition(":")
    try:
        found = read_states(component, names.split(","))
    except Exception as exc:  # said on the release's line; the tests still run and say the rest
        found = {"error": f"{type(exc).__name__}: {exc}"}
    Path(path).write_text(json.dumps(found))
