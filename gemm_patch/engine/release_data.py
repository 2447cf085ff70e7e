"""The release data of every target: ``releases.json`` beside this module, read once.

What each target relies on in each release (its fingerprints), the upstream code that fixes a
defect itself (``fixed_upstream``), the tables a target keeps beside those, and the pinned
Megatron-LM main commit. The targets keep their behaviour in code and take their tables from
here (``Target``); ``compat/adopt.py`` records a new release by writing this file. Standard
library only: ``import gemm_patch`` stays cheap.
"""

from __future__ import annotations

import json
import os
from typing import Any

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "releases.json")
_loaded: dict[str, Any] | None = None


def load() -> dict[str, Any]:
    """The whole file, parsed on first use."""
    global _loaded
    if _loaded is None:
        with open(PATH, encoding="utf-8") as handle:
            _loaded = json.load(handle)
    return _loaded


def target(name: str) -> dict[str, Any]:
    """The entry of target ``name``: distribution, fingerprints, and the optional tables."""
    entries = load()["targets"]
    if name not in entries:
        raise KeyError(f"{PATH} has no entry for target {name!r}; it has {', '.join(entries)}")
    return entries[name]


def main_commit() -> str:
    """The Megatron-LM main commit whose code the tables record (keyed ``main@<8 hex>``)."""
    return load()["megatron_main"]["commit"]


def distributions() -> tuple[str, ...]:
    """The distributions whose versions key the targets' tables, in the file's order."""
    return tuple(dict.fromkeys(entry["distribution"] for entry in load()["targets"].values()))


def not_applicable(name: str) -> dict[str, str]:
    """Target ``name``'s code with nothing to fix (fingerprint -> what that code is): its entry's
    ``not_applicable`` table and, where the entry names an ``other_form`` (another target that
    patches the other form of the same function), every fingerprint that target records."""
    entry = target(name)
    table: dict[str, str] = {}
    other = entry.get("other_form")
    if other:
        for release, fingerprint in target(other)["fingerprints"].items():
            table.setdefault(fingerprint, f"the code {other} patches ({target(other)['distribution']} {release})")
    table.update(entry.get("not_applicable", {}))
    return table
