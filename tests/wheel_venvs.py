"""The ``venvs`` fixture (a pytest plugin, named in ``pytest_plugins`` by the test modules that
use it, so that the wheel is built once per test run): two fresh virtual environments, one with
the gemm-patch wheel installed (built here, offline, from the source tree), one without; and
how to run their interpreters so that gemm_patch comes from the wheel, never the source tree.
``wheel`` and ``venv_with`` give a test a venv of its own, one it may damage.

Each venv gets this environment's packages (torch, wrapt, ...) through a path-only .pth file
sorted before gemm_patch's, the way they would sit in its own site-packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from process_env import ROOT, clean_env


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _make_venv(venv: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = _venv_python(venv)
    deps = _site_packages(python) / "a_test_dependencies.pth"
    deps.write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """The gemm-patch wheel, built once per test run, offline, from the source tree."""
    tmp = tmp_path_factory.mktemp("wheel")
    try:
        import hatchling  # noqa: F401  (the build backend: build offline, without isolation)
        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                    "-w", str(tmp), str(ROOT)], check=True, capture_output=True)
    return next(tmp.glob("gemm_patch-*.whl"))


def venv_with(wheel: Path, venv: Path) -> Path:
    """A fresh venv at ``venv`` with ``wheel`` installed: its python (one a test may damage)."""
    python = _make_venv(venv)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True)
    return python


@pytest.fixture(scope="session")
def venvs(tmp_path_factory, wheel):
    """(python with the gemm-patch wheel installed, python of an identical venv without it)."""
    tmp = tmp_path_factory.mktemp("auto")
    return venv_with(wheel, tmp / "with-wheel"), _make_venv(tmp / "plain")


def env_for(megatron: bool = False, path: tuple[Path, ...] = (), **variables: str) -> dict[str, str]:
    env = clean_env(megatron=megatron, **variables)
    # Not the source tree: gemm_patch must come from the installed wheel.
    entries = [str(p) for p in path] + [p for p in env["PYTHONPATH"].split(os.pathsep) if p and Path(p) != ROOT]
    env["PYTHONPATH"] = os.pathsep.join(entries)
    return env


def run(python, args, env, cwd):
    return subprocess.run([str(python), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=240)
