"""Shared by the tests that start real processes (launcher, auto switch, doctor): where the
tools are, and a clean environment that imports one megatron-core release of the matrix."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tests" / "probes" / "fsdp_probe.py"
BIN = Path(sys.executable).parent

# One release of compat/matrix.json with the call site (verified there): installed on first
# use by compat/matrix.py, so a fresh clone needs nothing by hand.
MEGATRON_RELEASE = "0.17.1"

sys.path.insert(0, str(ROOT / "compat"))
import matrix  # noqa: E402

# On a child's PYTHONPATH (first): its sitecustomize hides the megatron of the interpreter's own
# site-packages, so the child imports megatron only from the entries after it.
ISOLATE = matrix.ISOLATE


def gemm_patch_command() -> list[str]:
    """The installed console script, as a user runs it (``python -m gemm_patch`` without one)."""
    script = shutil.which("gemm-patch", path=str(BIN))
    return [script] if script else [sys.executable, "-m", "gemm_patch"]


def clean_env(megatron: bool = False, **variables: str) -> dict[str, str]:
    """os.environ without any GEMM_PATCH_* setting of the caller's, this interpreter's bin
    first on PATH (so ``python`` is it), gemm_patch importable from the source tree, and, with
    ``megatron``, the test release on PYTHONPATH too: then the release is the only megatron the
    process can import (compat/isolate hides one of this interpreter's site-packages, where a
    user's venv may hold megatron-core). A test that needs megatron absent says so with
    without_installed_megatron."""
    base = matrix.release_env(MEGATRON_RELEASE) if megatron else dict(os.environ)
    env = {k: v for k, v in base.items() if not k.startswith("GEMM_PATCH")}
    if not megatron:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env["PYTHONWARNINGS"] = "ignore"
    env.update(variables)
    return env


def without_installed_megatron(env: dict[str, str], *path: str) -> dict[str, str]:
    """``env`` with PYTHONPATH = compat/isolate, then ``path``, then the entries of its own
    PYTHONPATH that hold no megatron: the process imports megatron-core and megatron-fsdp only
    from ``path`` (or from entries it adds itself), not from the site-packages of its interpreter."""
    own = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep)
           if entry and entry != str(ISOLATE) and not matrix.holds_megatron(entry)]
    return {**env, "PYTHONPATH": os.pathsep.join([str(ISOLATE), *path, *own])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_error_lines(stderr: str, variable: str) -> list[str]:
    return [line for line in stderr.splitlines() if f"{variable}=" in line]
