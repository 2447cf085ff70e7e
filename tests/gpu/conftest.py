"""GPU tests: run on a CUDA machine with Transformer Engine and megatron-core releases laid out
as the device kit does (/tmp/gp/mcXYZ per release; GEMM_PATCH_MCORE_ROOT overrides):

    source .devkit/setup.sh && mcore 0.17.1 && PYTHONPATH=$PWD:$PYTHONPATH python3 -m pytest tests/gpu -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]  # nothing here can run without CUDA

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MCORE_ROOT = Path(os.environ.get("GEMM_PATCH_MCORE_ROOT", "/tmp/gp"))


def mcore_dir(version: str) -> Path:
    path = MCORE_ROOT / f"mc{version.replace('.', '')}"
    if not path.is_dir():
        pytest.skip(f"megatron-core {version} not laid out at {path}")
    return path


def run_probe(version: str, tmp_path: Path, cases: str, env: dict[str, str], tag: str) -> dict:
    """Run tests/gpu/wgrad_probe.py in its own interpreter against one megatron-core release."""
    out = tmp_path / f"{tag}.json"
    others = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and "/mc0" not in p]
    child_env = {**os.environ, **env,
                 "PYTHONPATH": os.pathsep.join([str(mcore_dir(version)), str(ROOT), *others])}
    proc = subprocess.run([sys.executable, str(HERE / "wgrad_probe.py"), "--cases", cases, "--json", str(out)],
                          env=child_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    result["stderr"] = proc.stderr
    return result
