"""Print the fingerprint of every registered target (``gemm_patch.targets.REGISTRY``) in the
releases found on sys.path: one line per target whose module imports.

    PYTHONPATH=compat/.cache/mcore-0.17.1:. python compat/fingerprint.py
    PYTHONPATH=compat/.cache/mfsdp-0.6.1:. python compat/fingerprint.py

Each line is one entry of the target's ``fingerprints`` table in gemm_patch/engine/releases.json (what
compat/adopt.py records once the target's tests pass); the comment says whether the value is
recorded for this release already, or for another.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["GEMM_PATCH"] = "0"  # look at the unpatched source

from gemm_patch.engine import detection  # noqa: E402
from gemm_patch.engine.callsite import CallSiteError  # noqa: E402
from gemm_patch.engine.target import public_version  # noqa: E402
from gemm_patch.targets import REGISTRY  # noqa: E402


def main() -> int:
    for target in REGISTRY:
        version = public_version(detection.distribution_version(target.distribution))
        try:
            module = importlib.import_module(target.module)
        except ImportError as exc:
            print(f"# {target.name}: {target.module} not importable ({exc})")
            continue
        try:
            found = target.inspect(module)
        except CallSiteError as exc:
            print(f"# {target.name} {target.distribution} {version}: {exc}")
            continue
        twins = [v for v, fp in target.fingerprints.items() if fp == found.fingerprint and v != version]
        recorded = target.fingerprints.get(version)
        note = ("recorded" if recorded == found.fingerprint
                else f"differs from the recorded {recorded}" if recorded
                else f"= {', '.join(twins)}" if twins else "new")
        applies = "" if found.applicable else f"; not applicable: {found.reason}"
        print(f'{target.name} {target.distribution} "{version}": "{found.fingerprint}",  # {note}{applies}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
