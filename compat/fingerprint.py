"""Print the fingerprint of each call-site target in the megatron-core found on sys.path.

    PYTHONPATH=/path/to/megatron-core python compat/fingerprint.py

Paste the value into the target's ``fingerprints`` table in gemm_patch/targets.py.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["GEMM_PATCH"] = "0"  # look at the unpatched source

from gemm_patch import detection  # noqa: E402
from gemm_patch.callsite import CallSiteError, analyse  # noqa: E402
from gemm_patch.targets import TARGETS  # noqa: E402


def main() -> int:
    for target in TARGETS:
        if not hasattr(target, "call"):
            continue
        module = importlib.import_module(target.module)
        version = detection.distribution_version("megatron-core")
        try:
            found = analyse(module, target.owner, target.attribute, target.call)
        except CallSiteError as exc:
            print(f"{target.name} {version}: {exc}")
            continue
        print(f'{target.name} "{version}": "{found.fingerprint}",  # {len(found.matches)} call site(s)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
