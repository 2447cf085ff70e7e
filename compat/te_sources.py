"""Fetch the three Transformer Engine files the te-dummy-wgrad target reads (``base.py``,
``linear.py``, ``layernorm_linear.py`` of ``transformer_engine/pytorch/module/``) for every TE
release it records: tests/test_te_dummy_target.py runs TE's own ``get_dummy_wgrad`` from them.
TE cannot be imported without its CUDA library, so each release's pure-Python wheel
(``transformer_engine-X-py3-none-any.whl``, under 1.3 MB) is downloaded with ``pip download
--no-deps`` and only those files are unpacked into ``compat/.cache/te-X/``; a release already
there is skipped.

    python compat/te_sources.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pypi_files import CACHE, fetch_all, unpack  # noqa: E402

FILES = tuple(f"transformer_engine/pytorch/module/{name}.py" for name in ("base", "linear", "layernorm_linear"))


def releases() -> list[str]:
    from gemm_patch.targets.te_dummy_wgrad import TARGET

    return list(TARGET.fingerprints)


def fetch(version: str) -> str:
    target = CACHE / f"te-{version}"
    if all((target / name).is_file() for name in FILES):
        return f"transformer-engine {version}: cached"
    count = unpack(f"transformer_engine=={version}", target, FILES.__contains__, ("--python-version", "3.12"))
    return f"transformer-engine {version}: unpacked {count} files"


if __name__ == "__main__":
    sys.exit(fetch_all(fetch, releases()))
