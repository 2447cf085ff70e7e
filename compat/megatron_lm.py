"""Megatron-LM source at one commit, unpacked under compat/.cache as installed packages:
``megatron/core`` as ``mcore-main-<8 hex>/`` (a package tree as ``pip install --target`` lays it
out; main's optional C++ helper is not needed) and its ``megatron_fsdp`` as ``mfsdp-main-<8 hex>/``
with the dist-info metadata pip would write.

The source comes from ``GEMM_PATCH_MEGATRON_LM`` (a Megatron-LM clone, bare or not, holding the
commit: ``git archive``), else from GitHub's tarball of the commit. Shared by
tests/test_mcore_main_targets.py and compat/adopt.py.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from pathlib import Path

CACHE = Path(__file__).resolve().parent / ".cache"
MARKER = ".gemm_patch_commit"
FSDP_SRC = "megatron/core/distributed/fsdp/src/megatron_fsdp"
CLONE = "GEMM_PATCH_MEGATRON_LM"


def tarball(commit: str) -> str:
    return f"https://codeload.github.com/NVIDIA/Megatron-LM/tar.gz/{commit}"


def folders(commit: str, cache: Path = CACHE) -> tuple[Path, Path]:
    """Where megatron-core and megatron-fsdp of ``commit`` are unpacked."""
    return cache / f"mcore-main-{commit[:8]}", cache / f"mfsdp-main-{commit[:8]}"


def _members(tar: tarfile.TarFile, strip: str):
    for member in tar:
        if member.name.startswith(strip) and (member.isfile() or member.isdir()):
            member.name = member.name[len(strip):]
            if member.name:
                yield member


def _extract(tar: tarfile.TarFile, into: Path, members) -> None:
    if hasattr(tarfile, "data_filter"):
        tar.extractall(into, members=members, filter="data")
    else:  # Python before 3.10.12 / 3.11.4
        tar.extractall(into, members=members)


def _extract_core(commit: str, into: Path, clone: str | None) -> str | None:
    """``megatron/core`` at ``commit`` into ``into``; None, or why it could not be had."""
    short = commit[:8]
    if clone:
        out = subprocess.run(["git", "-C", clone, "archive", "--format=tar", commit, "megatron/core"],
                             capture_output=True, timeout=300)
        if out.returncode != 0:
            return f"{CLONE}={clone}: git archive {short} failed: {out.stderr.decode()[-300:]}"
        with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
            _extract(tar, into, _members(tar, ""))
        return None
    try:
        with urllib.request.urlopen(tarball(commit), timeout=60) as response, \
                tarfile.open(fileobj=response, mode="r|gz") as tar:
            _extract(tar, into, _members(tar, f"Megatron-LM-{commit}/"))
    except OSError as exc:
        return (f"Megatron-LM @ {short} is not available: {tarball(commit)} unreachable ({exc}); set "
                f"{CLONE} to a Megatron-LM clone holding that commit")
    return None


def prepare(commit: str, cache: Path = CACHE, clone: str | None = None) -> str | None:
    """Unpack megatron-core and megatron-fsdp of ``commit`` (once) into ``folders(commit)``;
    None, or why they could not be had. ``clone`` defaults to ``GEMM_PATCH_MEGATRON_LM``."""
    mcore, mfsdp = folders(commit, cache)
    if (mcore / MARKER).is_file() and (mfsdp / MARKER).is_file():
        return None
    clone = clone or os.environ.get(CLONE)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        staging = Path(tmp) / "src"
        why = _extract_core(commit, staging, clone)
        if why:
            return why
        if not (staging / "megatron/core/tensor_parallel/layers.py").is_file():
            return f"Megatron-LM @ {commit[:8]}: no megatron/core in what was fetched"
        # megatron-fsdp as ``pip install --target`` lays it out: the package and its dist-info.
        fsdp = Path(tmp) / "mfsdp"
        shutil.copytree(staging / FSDP_SRC, fsdp / "megatron_fsdp")
        info: dict = {}
        exec((fsdp / "megatron_fsdp/package_info.py").read_text(), info)
        dist = fsdp / f"megatron_fsdp-{info['__version__']}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: megatron-fsdp\nVersion: {info['__version__']}\n")
        (dist / "INSTALLER").write_text("gemm_patch tests\n")
        for tree, target in ((staging, mcore), (fsdp, mfsdp)):
            (tree / MARKER).write_text(commit + "\n")
            shutil.rmtree(target, ignore_errors=True)
            tree.rename(target)
    return None
