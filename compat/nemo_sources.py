"""Fetch the one NeMo file the nemo-fsdp-gaf target reads, for every nemo-toolkit release it
records (and 3.0.0, which has none): tests/test_nemo_target.py runs NeMo's own ``init_ddp`` from
it. NeMo cannot be imported without its dependency chain (lightning, omegaconf, ...), so each
wheel is downloaded (``pip download --no-deps``, ~60 MB) and only ``nemo/lightning/`` is unpacked
into ``compat/.cache/nemo-X/``; a release already there is skipped.

    python compat/nemo_sources.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pypi_files import CACHE, fetch_all, unpack  # noqa: E402


def releases() -> list[str]:
    from gemm_patch.targets.nemo_fsdp_gaf import TARGET

    return [*TARGET.fingerprints, "3.0.0"]


def fetch(version: str) -> str:
    target = CACHE / f"nemo-{version}"
    if (target / "nemo" / "lightning").is_dir():
        return f"nemo-toolkit {version}: cached"
    unpack(f"nemo-toolkit=={version}", target,
           lambda name: name.startswith("nemo/lightning/") or name == "nemo/__init__.py")
    return f"nemo-toolkit {version}: unpacked nemo/lightning/"


if __name__ == "__main__":
    sys.exit(fetch_all(fetch, releases()))
