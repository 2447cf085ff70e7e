"""The README's samples are what a user gets: its demo, log and status blocks against the real
``gemm-patch demo`` and ``gemm-patch status`` on the README's release (megatron-core 0.16.1, the
one its "Try it" installs), line for line. Only what differs from one machine to the next is
normalised: gemm-patch's and torch's versions and the demo's error figures. The runs are the ones
tests/test_cli.py makes (``on_release``): no process of its own where both files run.

And the install lines run as written: no placeholder, nothing but the checkout they stand in.
"""

from __future__ import annotations

import re

import pytest
from process_env import ROOT
from test_cli import RELEASE, on_release

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```$", README, re.S | re.M)
# A source tree, not an installed package (the tests' own checkout may be either): a line the
# README's editable install does not print.
SOURCE_TREE_NOTE = "  note: gemm_patch is imported from a source tree"


def normalised(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        line = re.sub(r"^gemm_patch \d+\.\d+\.\d+\S*:", "gemm_patch <version>:", line)
        line = re.sub(r"torch \d+\.\d+\.\d+\S*?(?=[,)]|$)", "torch <version>", line)
        line = re.sub(r"\d\.\d\de-\d\d", "<x.xxe-xx>", line)
        out.append(line.rstrip())
    return out


def block(marker: str) -> list[str]:
    found = [text for _, text in BLOCKS if marker in text]
    assert len(found) == 1, f"README: {len(found)} blocks hold {marker!r}"
    return found[0].rstrip("\n").split("\n")


def transcript(command: str) -> list[str]:
    """What the terminal shows: the log lines (stderr) come while megatron is imported, before
    the command prints anything."""
    proc = on_release(command)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines() + proc.stdout.splitlines()
    return [line for line in lines if not line.startswith(SOURCE_TREE_NOTE)]


def test_readme_names_the_release_it_shows():
    assert f"megatron-core=={RELEASE}" in README and f"(megatron-core {RELEASE}, torch" in README


def test_demo_block_is_the_real_demo():
    assert normalised(block("unpatched, fp32 main_grad:")) == normalised(transcript("demo"))


def test_status_block_is_the_real_status():
    assert normalised(block(": applied\n")) == normalised(transcript("status"))


def test_log_block_is_the_real_log():
    logged = [line for line in on_release("status").stderr.splitlines() if line.startswith("[gemm_patch] ")]
    logs = [text.rstrip("\n").split("\n") for _, text in BLOCKS
            if text.strip() and all(line.startswith("[gemm_patch] INFO:") for line in text.strip().split("\n"))]
    assert logs == [logged], "README: the block of log lines"


@pytest.mark.parametrize("line", [line for kind, text in BLOCKS if kind == "bash" for line in text.splitlines()
                                  if line.strip() and not line.lstrip().startswith("#")])
def test_commands_run_as_written(line):
    command = line.split("  #")[0]
    assert "<" not in command and "/path/to" not in command, f"a placeholder: {line}"
    assert not re.search(r"@v\d", command), f"a tag: {line}"
