"""pytest under torchrun with one JUnit file per rank: ``pytest_rank.py PREFIX PYTEST_ARGS...``
writes PREFIX.rankR.xml (R = $RANK), so rank 0's counts can be read after the run, and gives each
rank its own --basetemp (PREFIX.tmp.rankR): two concurrent pytest sessions would otherwise share
/tmp/pytest-of-USER and may clean up each other's folders."""

import os
import sys

import pytest

if __name__ == "__main__":
    prefix, args = sys.argv[1], sys.argv[2:]
    rank = os.environ.get("RANK", "0")
    sys.exit(pytest.main([*args, f"--junitxml={prefix}.rank{rank}.xml", f"--basetemp={prefix}.tmp.rank{rank}"]))
