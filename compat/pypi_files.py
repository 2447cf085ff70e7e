"""Unpack chosen files of one PyPI wheel into compat/.cache: for the targets whose package
cannot be imported here (NeMo without its dependency chain, Transformer Engine without its CUDA
library), the tests read the release's own files instead (compat/nemo_sources.py,
compat/te_sources.py)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CACHE = Path(__file__).resolve().parent / ".cache"


def unpack(requirement: str, target: Path, wanted: Callable[[str], bool], pip_args: Iterable[str] = ()) -> int:
    """``pip download --no-deps`` the wheel of ``requirement``; extract the members ``wanted``
    accepts into ``target``; return how many."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", *pip_args, "-d", tmp, requirement], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            names = [name for name in archive.namelist() if wanted(name)]
            for name in names:
                archive.extract(name, target)
    return len(names)


def fetch_all(fetch: Callable[[str], str], versions: Iterable[str]) -> int:
    with ThreadPoolExecutor(max_workers=4) as pool:
        for line in pool.map(fetch, versions):
            print(line, flush=True)
    return 0
