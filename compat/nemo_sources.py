"""Fetch the one NeMo file the nemo-fsdp-gaf target reads, for every nemo-toolkit release it
records (and 3.0.0, which has none): tests/test_nemo_target.py runs NeMo's own ``init_ddp`` from
it. NeMo cannot be imported without its dependency chain (lightning, omegaconf, ...), so each
wheel is downloaded (``pip download --no-deps``, ~60 MB) and only ``nemo/lightning/`` is unpacked
into ``compat/.cache/nemo-X/``; a release already there is skipped.

    python compat/nemo_sources.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "compat" / ".cache"
sys.path.insert(0, str(ROOT))


def releases() -> list[str]:
    from gemm_patch.targets.nemo_fsdp_gaf import TARGET

    return [*TARGET.fingerprints, "3.0.0"]


def fetch(version: str) -> str:
    target = CACHE / f"nemo-{version}"
    if (target / "nemo" / "lightning").is_dir():
        return f"nemo-toolkit {version}: cached"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "-d", tmp, f"nemo-toolkit=={version}"], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.startswith("nemo/lightning/") or name == "nemo/__init__.py":
                    archive.extract(name, target)
    return f"nemo-toolkit {version}: unpacked nemo/lightning/"


def main() -> int:
    with ThreadPoolExecutor(max_workers=4) as pool:
        for line in pool.map(fetch, releases()):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
