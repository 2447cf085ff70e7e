"""Print the fingerprint of each target (call site, apex usage, Megatron-FSDP's
overwrite_main_grad method) in the megatron-core (and megatron-fsdp) found on sys.path.

    PYTHONPATH=/path/to/megatron-core python compat/fingerprint.py

Paste the value into the target's ``fingerprints`` table in gemm_patch/targets.py.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["GEMM_PATCH"] = "0"  # look at the unpatched source

from gemm_patch import detection  # noqa: E402
from gemm_patch.apex_analysis import analyse as analyse_apex  # noqa: E402
from gemm_patch.callsite import CallSiteError, analyse, analyse_statement  # noqa: E402
from gemm_patch.targets import TARGETS, OverwriteFlagTarget  # noqa: E402


def main() -> int:
    for target in TARGETS:
        version = detection.distribution_version(target.distribution)
        try:
            module = importlib.import_module(target.module)
        except ImportError as exc:
            print(f"{target.name} {target.distribution} {version}: not importable ({exc})")
            continue
        if isinstance(target, OverwriteFlagTarget):
            try:
                found = analyse_statement(module, target.owner, target.attribute, target.statement)
            except CallSiteError as exc:
                print(f"{target.name} {version}: {exc}")
                continue
            if found is None:
                print(f"{target.name} {version}: {target.module} has no {target.owner}.{target.attribute}")
                continue
            print(f'{target.name} "{version}": "{found.fingerprint}",  # {target.distribution}, '
                  f'{len(found.matches)} `{target.statement}`')
            continue
        if hasattr(target, "extension"):
            usage = analyse_apex(module, target.extension, target.flag, target.calls)
            print(f'{target.name} "{version}": "{usage.fingerprint}",  # {len(usage.calls)} call(s), '
                  f'{len(usage.checks)} check(s), guarded import {usage.guarded_import is not None}')
            continue
        try:
            found = analyse(module, target.owner, target.attribute, target.call)
        except CallSiteError as exc:
            print(f"{target.name} {version}: {exc}")
            continue
        print(f'{target.name} "{version}": "{found.fingerprint}",  # {len(found.matches)} call site(s)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
