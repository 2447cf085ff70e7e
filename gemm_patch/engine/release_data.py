"""The release data of every target: ``releases.json`` beside this module, read once.

What each target relies on in each release (its fingerprints), the upstream code that fixes a
defect itself (``fixed_upstream``), the tables a target keeps beside those, and the pinned
Megatron-LM main commit. The targets keep their behaviour in code and take their tables from
here (``Target``); ``compat/adopt.py`` records a new release by writing this file. Standard
library only: ``import gemm_patch`` stays cheap.

A damaged file (missing, not JSON, a wrong type, a target's entry missing: a half-removed or
hand-edited install) never raises into the host's ``import gemm_patch``: the functions here
answer with empty tables, ``problem()`` says what is wrong in one line naming the file, and
the patcher applies nothing because of it.
"""

from __future__ import annotations

import json
import os
from typing import Any

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "releases.json")
FIX = "reinstall gemm-patch (pip install --force-reinstall gemm-patch)"
_EMPTY: dict[str, Any] = {"targets": {}, "megatron_main": {"commit": ""}}
_TABLES = ("fingerprints", "fixed_upstream", "not_applicable")
_loaded: dict[str, Any] | None = None
_problem: str | None = None


def _damage(data: Any) -> str | None:
    """What makes ``data`` unusable as the release data, else None."""
    if not isinstance(data, dict):
        return f"holds a JSON {type(data).__name__}, not an object"
    if not isinstance(data.get("targets"), dict):
        return "has no 'targets' object"
    for name, entry in data["targets"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("distribution"), str):
            return f"target {name!r}: not an object with a 'distribution' string"
        if "fingerprints" not in entry or any(not isinstance(entry.get(table, {}), dict) for table in _TABLES):
            return (f"target {name!r} needs a 'fingerprints' object ('fixed_upstream' and 'not_applicable', "
                    f"where present, objects too)")
    main = data.get("megatron_main")
    if not isinstance(main, dict) or not isinstance(main.get("commit"), str):
        return "has no 'megatron_main' object with a 'commit' string"
    return None


def _note(problem: str) -> None:
    global _problem
    if _problem is None:
        _problem = f"{PATH} {problem}; {FIX}"


def load() -> dict[str, Any]:
    """The whole file, parsed on first use (empty tables where it is damaged: ``problem()``)."""
    global _loaded
    if _loaded is None:
        try:
            with open(PATH, encoding="utf-8") as handle:
                data = json.load(handle)
            problem = _damage(data)
        except OSError as exc:
            data, problem = None, f"cannot be read ({exc.strerror or type(exc).__name__})"
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            data, problem = None, f"is not valid JSON ({exc})"
        if problem:
            _note(problem)
        _loaded = _EMPTY if problem else data
    return _loaded


def problem() -> str | None:
    """What is wrong with the release data, in one line naming the file; None where it is whole."""
    load()
    return _problem


def target(name: str) -> dict[str, Any]:
    """The entry of target ``name``: distribution, fingerprints, and the optional tables."""
    entries = load()["targets"]
    if name not in entries:
        raise KeyError(f"{PATH} has no entry for target {name!r}; it has {', '.join(entries)}")
    return entries[name]


def entry(name: str) -> dict[str, Any]:
    """``target(name)`` for a target of the registry: where the file has no entry for it, empty
    tables, and ``problem()`` says so."""
    try:
        return target(name)
    except KeyError:
        _note(f"has no entry for target {name!r}")
        return {"fingerprints": {}}


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
    own = entry(name)
    table: dict[str, str] = {}
    other = own.get("other_form")
    if other:
        for release, fingerprint in entry(other)["fingerprints"].items():
            table.setdefault(fingerprint, f"the code {other} patches ({entry(other).get('distribution')} {release})")
    table.update(own.get("not_applicable", {}))
    return table
