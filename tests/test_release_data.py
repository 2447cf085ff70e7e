"""gemm_patch/engine/releases.json, the release data of every target: its schema, its agreement with the
registry, and the form compat/adopt.py writes (so an adoption's diff is the new lines only)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.version import InvalidVersion, Version

from gemm_patch.engine import release_data
from gemm_patch.targets import REGISTRY
from gemm_patch.upstream import megatron_main

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "compat"))
import adopt  # noqa: E402

DATA = release_data.load()
ENTRY_KEYS = {"distribution", "note", "fingerprints", "fixed_upstream", "param_arg_fingerprints", "not_applicable",
              "other_form", "reports_only"}
HEX16 = re.compile(r"[0-9a-f]{16}")


def test_every_registered_target_has_an_entry_and_every_entry_a_target():
    assert list(DATA["targets"]) == [t.name for t in REGISTRY]


@pytest.mark.parametrize("target", REGISTRY, ids=lambda t: t.name)
def test_entry_schema(target):
    entry = DATA["targets"][target.name]
    assert set(entry) <= ENTRY_KEYS and {"distribution", "fingerprints"} <= set(entry), sorted(entry)
    # The distribution whose version keys the table (megatron-core's and megatron-fsdp's tables
    # of the same code hold the same fingerprints, each under its own versions).
    assert entry["distribution"] == target.distribution
    if entry.get("reports_only"):
        # A target that patches nothing (it reports code gemm-patch has not verified): no release
        # to record, and its install never runs.
        from gemm_patch.engine.target import Inspection

        assert entry["reports_only"] is True and not entry["fingerprints"], entry
        with pytest.raises(AssertionError, match="installs nothing"):
            target.install(None, Inspection("0" * 16, True, ""), None, None)
    else:
        assert entry["fingerprints"], "an entry records at least one release"
    for key, fingerprint in entry["fingerprints"].items():
        if key.startswith("main@"):
            assert target.distribution in ("megatron-core", "megatron-fsdp"), key
            assert key == megatron_main.RELEASE, f"{key}: main is keyed by the pinned commit {megatron_main.RELEASE}"
        else:
            try:
                assert str(Version(key)) == key and Version(key).public == key, f"{key}: not a public release"
            except InvalidVersion:
                pytest.fail(f"{target.name}: {key!r} is not a version")
        assert HEX16.fullmatch(fingerprint), f"{target.name} {key}: {fingerprint!r} is not 16 hex digits"
    assert list(entry["fingerprints"]) == sorted(entry["fingerprints"], key=adopt._version_key), \
        "releases in version order, main last"
    for fingerprint, change in entry.get("fixed_upstream", {}).items():
        assert HEX16.fullmatch(fingerprint) and change.strip(), (fingerprint, change)
        assert fingerprint not in entry["fingerprints"].values(), f"{fingerprint} is both fixed upstream and patched"
    assert all(HEX16.fullmatch(fp) for fp in entry.get("param_arg_fingerprints", ())), entry
    for fingerprint, what in entry.get("not_applicable", {}).items():
        assert HEX16.fullmatch(fingerprint) and what.strip(), (fingerprint, what)
        assert fingerprint not in entry["fingerprints"].values(), f"{fingerprint} is both nothing to fix and patched"
    if "other_form" in entry:
        other = DATA["targets"][entry["other_form"]]
        assert other["distribution"] == entry["distribution"] and other.get("other_form") == target.name, \
            "two forms of one function name each other, under one distribution"


def test_the_target_reads_its_tables_from_the_file():
    for target in REGISTRY:
        entry = DATA["targets"][target.name]
        assert dict(target.fingerprints) == entry["fingerprints"], target.name
        assert dict(target.fixed_upstream) == entry.get("fixed_upstream", {}), target.name
        assert entry.get("not_applicable", {}).items() <= dict(target.not_applicable).items(), target.name
        if "other_form" in entry:
            assert set(DATA["targets"][entry["other_form"]]["fingerprints"].values()) <= set(target.not_applicable)


def test_main_pin():
    assert re.fullmatch(r"[0-9a-f]{40}", DATA["megatron_main"]["commit"])
    assert megatron_main.COMMIT == DATA["megatron_main"]["commit"]
    assert megatron_main.RELEASE == f"main@{megatron_main.COMMIT[:8]}"


def test_the_file_is_in_the_form_adopt_writes():
    assert Path(release_data.PATH).read_text(encoding="utf-8") == adopt.dump_releases(DATA)


def test_unknown_target_name_is_a_clear_error():
    with pytest.raises(KeyError, match="releases.json has no entry for target 'no-such-target'"):
        release_data.target("no-such-target")


def test_no_fingerprint_literal_in_the_package():
    found = [f"{path.relative_to(ROOT)}: {match}" for path in sorted((ROOT / "gemm_patch").rglob("*.py"))
             for match in re.findall(r"[\"'][0-9a-f]{16}[\"']", path.read_text())]
    assert not found, found
