"""Release radar: which releases on PyPI gemm-patch does not know yet, and what each one means.

    python compat/radar.py

Asks PyPI's JSON API (``https://pypi.org/pypi/<name>/json``) for the releases of every
distribution a target or the matrix keys on, and lists those not recorded:

* megatron-core, megatron-fsdp: not in compat/matrix.json (the version matrix);
* transformer-engine: not in te-dummy-wgrad's fingerprint table (transformer-engine-torch, TE's
  compiled extension, follows the transformer-engine release of the same version);
* nemo-toolkit: not in nemo-fsdp-gaf's table, nor recorded as not applicable
  (matrix.json ``radar.not_applicable``);
* megatron-bridge: not in matrix.json ``radar.validated`` (gemm-patch has no target in Bridge:
  the list is of the releases validated end to end).

Yanked releases and pre-releases are marked. Releases older than the oldest one recorded for a
distribution, and pre-releases older than the newest final release, are counted on one line each, not
listed. One block of output; PyPI not reachable is one
line. The exit status is always 0: the radar informs, it never fails a build.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MATRIX_FILE = ROOT / "compat" / "matrix.json"
INDEX = "https://pypi.org/pypi"
TIMEOUT = 5.0  # seconds per request
PACKAGES = ("megatron-core", "megatron-fsdp", "transformer-engine", "transformer-engine-torch", "nemo-toolkit",
            "megatron-bridge")

Fetch = Callable[[str], Mapping]  # distribution name -> PyPI's JSON document


class Unreachable(Exception):
    """The index did not answer (network, timeout, HTTP error other than 404)."""


def pypi_fetch(index: str = INDEX, timeout: float = TIMEOUT) -> Fetch:
    def fetch(name: str) -> Mapping:
        url = f"{index.rstrip('/')}/{name}/json"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return {"releases": {}}
            raise Unreachable(f"{url}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise Unreachable(f"{url}: {reason}") from None

    return fetch


# -- what gemm-patch knows -------------------------------------------------------------------------

@dataclass(frozen=True)
class Known:
    """Per distribution: the versions recorded, and those recorded as not applicable (why)."""

    recorded: Mapping[str, frozenset[str]]
    not_applicable: Mapping[str, Mapping[str, str]]


def known(matrix_file: Path = MATRIX_FILE) -> Known:
    from gemm_patch.targets import REGISTRY

    data = json.loads(matrix_file.read_text())
    recorded: dict[str, set[str]] = {}
    for component, spec in data["components"].items():
        recorded.setdefault(component, set()).update(entry["version"] for entry in spec["releases"])
    for target in REGISTRY:
        if target.distribution not in ("megatron-core", "megatron-fsdp"):  # those: the matrix
            recorded.setdefault(target.distribution, set()).update(
                v for v in target.fingerprints if not v.startswith("main@"))
    radar = data.get("radar", {})
    for name, versions in radar.get("validated", {}).items():
        recorded.setdefault(name, set()).update(versions)
    recorded["transformer-engine-torch"] = set(recorded.get("transformer-engine", ()))
    return Known({k: frozenset(v) for k, v in recorded.items()}, radar.get("not_applicable", {}))


# -- what PyPI has -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Seen:
    name: str
    version: str
    yanked: str | None  # the reason ("" when none is given), None when not yanked
    prerelease: bool
    recorded: bool
    not_applicable: str | None  # the recorded reason


def _key(version: str):
    from packaging.version import InvalidVersion, Version

    try:
        return (1, Version(version))
    except InvalidVersion:
        return (0, version)


def _prerelease(version: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).is_prerelease
    except InvalidVersion:
        return True


def releases(name: str, document: Mapping, known_: Known) -> list[Seen]:
    recorded = known_.recorded.get(name, frozenset())
    not_applicable = known_.not_applicable.get(name, {})
    seen = []
    for version, files in document.get("releases", {}).items():
        yanked = None
        if files and all(f.get("yanked") for f in files):
            yanked = next((f.get("yanked_reason") or "" for f in files if f.get("yanked_reason")), "")
        seen.append(Seen(name, version, yanked, _prerelease(version), version in recorded,
                         not_applicable.get(version)))
    return sorted(seen, key=lambda s: _key(s.version))


# -- what each one means ---------------------------------------------------------------------------

def meaning(s: Seen, known_: Known) -> str:
    v = s.version
    if s.not_applicable is not None:
        target = "nemo-fsdp-gaf" if s.name == "nemo-toolkit" else "gemm-patch"
        return f"{s.not_applicable}: {target} not applicable (recorded)"
    if s.name in ("megatron-core", "megatron-fsdp"):
        return (f"unknown to every target: gemm-patch leaves it alone until adopted "
                f"(`python compat/adopt.py {s.name}=={v}`), unless its code is identical to a recorded "
                "release's (compatible)")
    if s.name == "transformer-engine":
        return ("not in te-dummy-wgrad's table: its get_dummy_wgrad is left alone unless identical to a "
                "recorded release's; to record it, add it to te-dummy-wgrad's table once "
                "`python compat/te_sources.py` and tests/test_te_dummy_target.py pass on its files")
    if s.name == "transformer-engine-torch":
        return ("TE's compiled extension, read by no target; it pairs with transformer-engine " + v
                + (" (recorded)" if v in known_.recorded.get("transformer-engine", ()) else " (not recorded either)"))
    if s.name == "nemo-toolkit":
        return ("not in nemo-fsdp-gaf's table (opt-in): its init_ddp is left alone unless identical to a "
                "recorded release's; a release without nemo.lightning.megatron_parallel goes under "
                "matrix.json radar.not_applicable")
    if s.name == "megatron-bridge":
        validated = ", ".join(sorted(known_.recorded.get(s.name, ()), key=_key)) or "none"
        return (f"not validated with gemm-patch (validated: {validated}); no target reads Bridge's code: "
                "what it runs of megatron-core is judged by megatron-core's targets")
    return "unknown"


def describe(s: Seen, known_: Known) -> str:
    marks = []
    if s.yanked is not None:
        marks.append(f"yanked: {s.yanked}" if s.yanked else "yanked")
    if s.prerelease:
        marks.append("pre-release")
    head = f"{s.name} {s.version}" + (f" [{'; '.join(marks)}]" if marks else "")
    if s.yanked is not None:
        return f"{head}: yanked on PyPI: nothing to adopt"
    if s.prerelease and s.not_applicable is None:
        return f"{head}: {meaning(s, known_)}; a pre-release: wait for the final release"
    return f"{head}: {meaning(s, known_)}"


def radar(fetch: Fetch, known_: Known, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """The report's lines: PyPI not reachable -> one line."""
    lines: list[str] = []
    unknown = 0
    for index, name in enumerate(packages):
        try:
            document = fetch(name)
        except Unreachable as exc:
            if index == 0:
                return [f"radar: PyPI not reachable ({exc})"]
            lines.append(f"{name}: not read ({exc})")
            continue
        seen = releases(name, document, known_)
        if not seen:
            lines.append(f"{name}: no release on PyPI")
            continue
        recorded = [*known_.recorded.get(name, ()), *known_.not_applicable.get(name, {})]
        oldest = min(recorded, key=_key) if recorded else None
        floor = _key(oldest) if oldest else None
        older = [s for s in seen if floor is not None and _key(s.version) < floor and not s.recorded]
        # A pre-release older than the newest final release (on PyPI or recorded) is superseded.
        finals = [_key(s.version) for s in seen if not s.prerelease] + [_key(v) for v in recorded]
        newest = max(finals, default=None)
        superseded = [s for s in seen if s.prerelease and s not in older and not s.recorded
                      and newest is not None and _key(s.version) < newest]
        for s in seen:
            if s.recorded or s in older or s in superseded:
                continue
            if s.not_applicable is None and s.yanked is None:
                unknown += 1
            lines.append(describe(s, known_))
        if superseded:
            lines.append(f"{name}: {len(superseded)} pre-release(s) older than its newest final release not listed")
        if older:
            lines.append(f"{name}: {len(older)} release(s) older than {oldest} "
                         "(the oldest recorded) not listed")
    head = (f"radar: {unknown} release(s) on PyPI unknown to gemm-patch" if unknown
            else "radar: every release on PyPI is known to gemm-patch")
    return [head + f" ({', '.join(packages)})", *("  " + line for line in lines)]


def main(argv: list[str] | None = None, fetch: Fetch | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", default=INDEX, help="the JSON API's root (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per request")
    args = parser.parse_args(argv)
    try:
        known_ = known()
        lines = radar(fetch or pypi_fetch(args.index, args.timeout), known_)
    except Exception as exc:  # the radar informs, it never fails a build
        lines = [f"radar: failed ({type(exc).__name__}: {exc})"]
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # `| head`
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
