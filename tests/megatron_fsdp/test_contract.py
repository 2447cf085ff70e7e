"""The target contract (tests/contract.py) for every standalone megatron-fsdp target, on this release."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import EXPECTED

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import contract  # noqa: E402

contract.define_tests(globals(), "megatron-fsdp", EXPECTED)
