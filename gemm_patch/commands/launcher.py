"""``gemm-patch run -- COMMAND ...``: run a command with gemm_patch applied in every Python
process it starts (torchrun workers, srun tasks, multiprocessing spawn children included),
without editing the training script. The ``opentelemetry-instrument`` / ``ddtrace-run``
pattern: put a bootstrap directory holding a sitecustomize first on PYTHONPATH, set
GEMM_PATCH_AUTO=1, and exec the command. Children inherit both.

Why also GEMM_PATCH_AUTO=1: a child started with ``python -E``/``-I`` ignores PYTHONPATH but
still processes site-packages, so in an environment with the wheel's .pth file the variable
still patches it. The bootstrap itself starts the hook whatever GEMM_PATCH_AUTO says.
GEMM_PATCH is left alone: GEMM_PATCH=0 still turns everything off.

Either way the hook is lazy (``_gemm_patch_startup``): a child imports gemm_patch, and so
wrapt, only when it first imports megatron, megatron_fsdp, ...; the other Python processes a
job starts (tools, compilers' helpers, data workers that never touch megatron) pay nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

BOOTSTRAP_DIR = Path(__file__).resolve().parent.parent / "bootstrap"


def _is_bootstrap(entry: str) -> bool:
    return bool(entry) and os.path.normcase(os.path.abspath(entry)) == os.path.normcase(str(BOOTSTRAP_DIR))


def launch_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for the command: bootstrap first on PYTHONPATH (once, even when
    launchers nest), every other entry kept in order, GEMM_PATCH_AUTO=1."""
    env = dict(environ)
    existing = env.get("PYTHONPATH")
    # An empty PYTHONPATH means unset; empty entries inside one mean the current directory
    # to Python, so they are kept.
    rest = [e for e in existing.split(os.pathsep) if not _is_bootstrap(e)] if existing else []
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP_DIR), *rest])
    env["GEMM_PATCH_AUTO"] = "1"
    return env


def run(command: Sequence[str]) -> int:
    """Replace this process with ``command``; returns only when that cannot be done."""
    command = list(command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: gemm-patch run -- COMMAND [ARGS ...]", file=sys.stderr)
        return 2
    env = launch_env(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if os.name == "nt":  # no exec that keeps the process on Windows: wait for the child
            return subprocess.call(command, env=env)
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"gemm-patch run: {command[0]}: command not found", file=sys.stderr)
        return 127
    except OSError as exc:
        print(f"gemm-patch run: {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 126
    return 0  # not reached: execvpe does not return
