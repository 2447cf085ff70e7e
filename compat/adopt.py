"""Adopt a release, or a Megatron-LM commit, in one command: install it, fingerprint every target
of its component on its code, run the targets' tests against that code with the gate opened for
it, and record the fingerprint of each target whose tests pass.

    python compat/adopt.py megatron-core==0.20.0
    python compat/adopt.py megatron-fsdp==0.7.0
    python compat/adopt.py megatron-lm@<commit>        # megatron-core and megatron-fsdp of that commit
    python compat/adopt.py megatron-core==0.20.0 --dry-run   # what it would record; no file changes

A release is installed as the version matrix installs it (compat/matrix.py, under compat/.cache);
a commit is unpacked by compat/megatron_lm.py (``GEMM_PATCH_MEGATRON_LM``: a Megatron-LM clone
holding it, else GitHub's tarball). compat/fingerprint.py fingerprints each target on that code.
A child interpreter then runs the component's test folder (tests/megatron, tests/megatron_fsdp;
for a commit also tests/test_mcore_main_targets.py against it) with
``GEMM_PATCH_ALLOW_UNVERIFIED=1`` and ``GEMM_PATCH_MATRIX_EXPECT`` saying what each target reads on
that code (unknown code: ``forced``; not applicable: ``not applicable``). Each test is credited to
the targets its ``proves`` marker names (``@pytest.mark.proves("fsdp-wgrad")``; the contract's
tests name their target's), which compat/matrix_quick.py writes into the junit report.

A target is recorded only where at least one of its tests passed and none failed: one line in
its table in gemm_patch/engine/releases.json, in version order (a release) or keyed ``main@<8 hex>`` (a
commit; the file's ``megatron_main`` commit moves to it only where every applicable target
passes). A release also joins compat/matrix.json. Nothing else is written: adopting a release
changes data files only. A target whose test fails stays unverified: the test and the first
line of its failure are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import matrix  # noqa: E402
import megatron_lm  # noqa: E402

ROOT = matrix.ROOT
sys.path.insert(0, str(ROOT))
# The data files an adoption writes, relative to the repository (``adopt(root=...)``).
RELEASES = Path("gemm_patch") / "engine" / "releases.json"
MATRIX_JSON = matrix.MATRIX_FILE.relative_to(ROOT)
PATCHED = ("verified", "compatible", "forced")

from matrix_quick import PROVES  # noqa: E402  (the junit property naming the targets a test proves)

MAIN_TESTS = "tests/test_mcore_main_targets.py"
COMMIT_VARIABLE = "GEMM_PATCH_MAIN_COMMIT"  # tests/test_mcore_main_targets.py: the commit it tests


# -- what is adopted ------------------------------------------------------------------------

@dataclass
class Code:
    """One component's code to adopt: where it is installed and the key it is recorded under."""
    component: str
    key: str  # "0.20.0", or megatron_main's "main@<8 hex>"
    folders: list[Path]  # on the child's path
    tests: list[str]
    python: str | None = None
    commit: str | None = None
    release: matrix.Release | None = None


def parse_spec(spec: str) -> tuple[str, str]:
    if spec.startswith("megatron-lm@"):
        commit = spec.split("@", 1)[1]
        if not re.fullmatch(r"[0-9a-f]{40}", commit):
            raise SystemExit(f"{spec}: give the full 40-hex commit")
        return "megatron-lm", commit
    component, sep, version = spec.partition("==")
    if not sep or component not in _components():
        raise SystemExit(f"{spec}: expected megatron-core==X.Y.Z, megatron-fsdp==X.Y.Z or megatron-lm@<commit>")
    return component, version


def _components() -> dict:
    return json.loads(matrix.MATRIX_FILE.read_text())["components"]


def prepare(spec: str) -> list[Code]:
    kind, what = parse_spec(spec)
    if kind == "megatron-lm":
        why = megatron_lm.prepare(what)
        if why:
            raise SystemExit(why)
        mcore, mfsdp = megatron_lm.folders(what)
        key = f"main@{what[:8]}"
        return [Code("megatron-core", key, [mcore, mfsdp], ["tests/megatron", MAIN_TESTS], "3.12", what),
                Code("megatron-fsdp", key, [mfsdp], ["tests/megatron_fsdp"], "3.12", what)]
    spec_ = _components()[kind]
    known = {r.version: r for r in matrix.MATRIX if r.component == kind}
    release = known.get(what) or matrix.Release(kind, what, spec_["cache"], spec_["tests"])
    try:
        folder = matrix.ensure_release(release, matrix.interpreter_for(release))
    except subprocess.CalledProcessError as exc:
        if release.python or "Requires-Python" not in (exc.stderr or ""):
            raise SystemExit(f"pip install {kind}=={what} failed: {(exc.stderr or '').strip()[-800:]}") from None
        release = matrix.Release(kind, what, spec_["cache"], spec_["tests"], "3.12")
        folder = matrix.ensure_release(release, matrix.interpreter_for(release))
    return [Code(kind, what, [folder], [release.tests], release.python, release=release)]


def interpreter(code: Code) -> matrix.Interpreter:
    return matrix.interpreter_for(matrix.Release(code.component, code.key, "", "", code.python))


# -- fingerprints ---------------------------------------------------------------------------

_LINE = re.compile(r'^(\S+) (\S+) "([^"]*)": "([^"]*)",  # ([^;]*)(; not applicable: (.*))?$')


@dataclass
class Found:
    target: str
    fingerprint: str | None
    applicable: bool
    reason: str = ""


def fingerprints(code: Code, python: str) -> dict[str, Found]:
    """compat/fingerprint.py in a child with the code on its path: every target of the component."""
    env = matrix.folders_env(code.folders, {})
    out = subprocess.run([python, str(ROOT / "compat" / "fingerprint.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"compat/fingerprint.py failed: {out.stderr.strip()[-1500:]}")
    found = {}
    for line in out.stdout.splitlines():
        match = _LINE.match(line)
        if match and match.group(2) == code.component:
            fp = None if match.group(4) == "None" else match.group(4)
            found[match.group(1)] = Found(match.group(1), fp, match.group(6) is None, match.group(7) or "")
    return found


def judged(target, release: str | None, found: Found) -> str:
    """The state the target reads on this code with GEMM_PATCH_ALLOW_UNVERIFIED=1 (``Target.judge``;
    a commit has no release of its own: it reports the coming one's version)."""
    from gemm_patch.engine.config import Config
    from gemm_patch.engine.target import Inspection

    if not found.applicable:
        return "not applicable"
    return target.judge(release, Inspection(found.fingerprint, True, ""), Config(allow_unverified=True))[0]


# -- the tests ------------------------------------------------------------------------------

@dataclass
class Outcome:
    file: str
    name: str
    outcome: str  # passed, failed, skipped
    message: str = ""
    proves: tuple[str, ...] = ()  # its ``proves`` marker's targets; none: it is held against no target


def credited(case: Outcome, names: list[str]) -> list[str]:
    """The targets of ``names`` that a test proves (its ``proves`` marker)."""
    return [n for n in case.proves if n in names]


def run_tests(code: Code, python: str, expected: dict[str, str], extra: dict[str, str]) -> list[Outcome]:
    env = matrix.folders_env(code.folders, expected)
    env.update(GEMM_PATCH_ALLOW_UNVERIFIED="1", GEMM_PATCH_MATRIX_QUICK="0", NO_VCS_VERSION="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT / "compat")])
    junit = matrix.CACHE / "junit" / f"adopt-{code.component}-{code.key.replace('@', '-')}.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    proc = subprocess.run([python, "-m", "pytest", *code.tests, "-q", "-p", "no:cacheprovider",
                           "-p", "matrix_quick", f"--junitxml={junit}"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=matrix.CHILD_TIMEOUT)
    outcomes = []
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            module = next((part for part in reversed(case.get("classname", "").split("."))
                           if part.startswith("test_")), "")
            proves = tuple(name for prop in case.iter("property") if prop.get("name") == PROVES
                           for name in (prop.get("value") or "").split(",") if name)
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                text = bad.get("message") or bad.text or "?"
                outcomes.append(Outcome(module + ".py", case.get("name", "?"), "failed",
                                        text.strip().splitlines()[0] if text.strip() else "?", proves))
            else:
                outcomes.append(Outcome(module + ".py", case.get("name", "?"),
                                        "skipped" if case.find("skipped") is not None else "passed", proves=proves))
    if proc.returncode not in (0, 1) or not outcomes:
        tail = (proc.stdout[-1500:] + proc.stderr[-1500:]).strip()
        raise SystemExit(f"pytest {' '.join(code.tests)} did not run (exit {proc.returncode}): {tail}")
    return outcomes


# -- the verdict ----------------------------------------------------------------------------

@dataclass
class Verdict:
    target: str
    state: str  # what it read in the child: verified, compatible, forced, not applicable
    fingerprint: str | None
    passed: int = 0
    failures: list[Outcome] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.state == "not applicable" or (self.passed > 0 and not self.failures)

    def line(self) -> str:
        if self.state == "not applicable":
            return f"{self.target}: not applicable (nothing to record)"
        if not self.ok:
            why = ("no test of it ran" if not self.failures else
                   "; ".join(f"{f.file}::{f.name}: {f.message}" for f in self.failures[:3])
                   + (f" (+{len(self.failures) - 3} more)" if len(self.failures) > 3 else ""))
            return f"{self.target} {self.fingerprint}: left unverified ({self.state} here): {why}"
        return f"{self.target} {self.fingerprint}: {self.passed} tests passed ({self.state} here)"


def verdicts(found: dict[str, Found], expected: dict[str, str], outcomes: list[Outcome]) -> dict[str, Verdict]:
    names = list(expected)
    result = {n: Verdict(n, expected[n], found[n].fingerprint if n in found else None) for n in names}
    for case in outcomes:
        for name in credited(case, names):
            if case.outcome == "passed":
                result[name].passed += 1
            elif case.outcome == "failed":
                result[name].failures.append(case)
    return result


def unrecorded_without_site(all_verdicts: dict[str, Verdict], by_name: dict) -> list[str]:
    """Targets whose code here lacks what they patch (not applicable in the child, where the
    gate is open) while nothing records that code as having nothing to fix: neither the target's
    ``not_applicable`` nor ``fixed_upstream`` table, nor a target recorded now with the same
    fingerprint (the other form of the same function). With the gate closed they read unverified."""
    recorded_now = {v.fingerprint for v in all_verdicts.values() if v.state != "not applicable" and v.ok}
    lines = []
    for verdict in all_verdicts.values():
        target, fp = by_name[verdict.target], verdict.fingerprint
        if verdict.state != "not applicable" or fp is None or fp in recorded_now:
            continue
        if fp not in target.not_applicable and fp not in target.fixed_upstream:
            lines.append(f"{verdict.target}: its code ({fp}) lacks what the target patches and is recorded as "
                         f"having nothing to fix nowhere: it reads unverified until the target's not_applicable "
                         f"table records it (once the code is checked)")
    return lines


# -- recording --------------------------------------------------------------------------

def _version_key(key: str) -> tuple:
    from packaging.version import InvalidVersion, Version

    if key.startswith("main@"):
        return (1, Version("0"))
    try:
        return (0, Version(key))
    except InvalidVersion:
        return (0, Version("0"))


def set_fingerprint(table: dict[str, str], key: str, fp: str) -> None:
    """``key: fp`` in a fingerprint table (in place), the table kept in version order (releases
    by version, main keys last)."""
    table[key] = fp
    ordered = sorted(table.items(), key=lambda item: _version_key(item[0]))
    table.clear()
    table.update(ordered)


def move_main(data: dict, commit: str) -> None:
    """The release data pinned to Megatron-LM main ``commit``: every table's main key renamed."""
    old, new = f"main@{data['megatron_main']['commit'][:8]}", f"main@{commit[:8]}"
    data["megatron_main"]["commit"] = commit
    for entry in data["targets"].values():
        table = entry["fingerprints"]
        if old in table and old != new:
            entry["fingerprints"] = {new if k == old else k: v for k, v in table.items()}


def dump_releases(data: dict) -> str:
    """gemm_patch/engine/releases.json's text for ``data``: one entry a line, so a release is a line."""
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def add_release(text: str, component: str, version: str, python: str | None) -> str:
    """compat/matrix.json's text with the release in its component's list, in version order."""
    data = json.loads(text)
    releases = data["components"][component]["releases"]
    if any(r["version"] == version for r in releases):
        return text
    lines = text.splitlines(keepends=True)
    entry = json.dumps({"version": version, **({"python": python} if python else {})}, separators=(", ", ": "))
    rows = [i for i, line in enumerate(lines) if re.match(r'\s*\{"version": "', line)]
    comp_start = next(i for i, line in enumerate(lines) if line.strip().startswith(f'"{component}"'))
    rows = [i for i in rows if i > comp_start]
    rows = rows[:len(releases)]
    after = [i for i, r in zip(rows, releases, strict=True) if _version_key(r["version"]) < _version_key(version)]
    at = after[-1] if after else rows[0] - 1
    indent = re.match(r"\s*", lines[rows[0]]).group(0)
    if after and at == rows[-1]:  # the new last row: the previous one gains a comma
        lines[at] = lines[at].rstrip("\n") + ",\n"
        new = f"{indent}{entry}\n"
    else:
        new = f"{indent}{entry},\n"
    return "".join(lines[:at + 1]) + new + "".join(lines[at + 1:])


# -- the command ----------------------------------------------------------------------------

def adopt(spec: str, dry_run: bool = False, say=print, root: Path = ROOT) -> dict[str, Verdict]:
    """Measure the code of ``spec`` (fingerprints, then its tests) and record what passed in the
    data files of the repository at ``root``."""
    start = time.perf_counter()
    codes = prepare(spec)
    all_verdicts = measure(codes, say)
    complete = all(v.ok for v in all_verdicts.values())
    if record(codes, all_verdicts, complete, root, dry_run, say):
        applicable = [v for v in all_verdicts.values() if v.state != "not applicable"]
        say(f"{'complete' if complete else 'partial'}: {sum(v.ok for v in applicable)} of {len(applicable)} "
            f"applicable targets pass ({time.perf_counter() - start:.0f}s)")
    return all_verdicts


def measure(codes: list[Code], say) -> dict[str, Verdict]:
    """Each target's verdict on the code: its fingerprint there and the outcome of its tests."""
    from gemm_patch.targets import REGISTRY

    all_verdicts: dict[str, Verdict] = {}
    for code in codes:
        python = interpreter(code).python
        found = fingerprints(code, python)
        targets = [t for t in REGISTRY if t.distribution == code.component]
        release = None if code.commit else code.key
        expected = {t.name: judged(t, release, found[t.name]) if t.name in found else "not applicable"
                    for t in targets}
        say(f"{code.component} {code.key}: testing {', '.join(code.tests)} "
            f"({', '.join(f'{n} {s}' for n, s in expected.items() if s != 'not applicable') or 'nothing applies'})")
        extra = {COMMIT_VARIABLE: code.commit} if code.commit else {}
        outcomes = run_tests(code, python, expected, extra)
        counts = {o: sum(c.outcome == o for c in outcomes) for o in ("passed", "failed", "skipped")}
        say(f"  {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
        for case in outcomes:
            if case.outcome == "failed" and not credited(case, list(expected)):
                say(f"  failed, credited to no target: {case.file}::{case.name}: {case.message}")
        found_verdicts = verdicts(found, expected, outcomes)
        all_verdicts.update(found_verdicts)
        for verdict in found_verdicts.values():
            say("  " + verdict.line())
    for line in unrecorded_without_site(all_verdicts, {t.name: t for t in REGISTRY}):
        say("  " + line)
    return all_verdicts


def record(codes: list[Code], all_verdicts: dict[str, Verdict], complete: bool, root: Path, dry_run: bool,
           say) -> bool:
    """Write what passed into the data files under ``root`` (gemm_patch/engine/releases.json,
    compat/matrix.json) and nothing else; False where a commit is not adopted at all."""
    releases_file, matrix_file = root / RELEASES, root / MATRIX_JSON
    releases_text = releases_file.read_text()
    data = json.loads(releases_text)
    commit = codes[0].commit
    if commit:
        pinned = data["megatron_main"]["commit"]
        if commit != pinned and not complete:
            say(f"not every target passes on {commit[:8]}: nothing recorded, the pinned main commit stays "
                f"{pinned[:8]}")
            return False
        move_main(data, commit)
    key = f"main@{commit[:8]}" if commit else codes[0].key
    for verdict in all_verdicts.values():
        if verdict.state == "not applicable" or not verdict.ok or verdict.fingerprint is None:
            continue
        table = data["targets"][verdict.target]["fingerprints"]
        if table.get(key) == verdict.fingerprint:
            continue
        set_fingerprint(table, key, verdict.fingerprint)
        say(f"record {verdict.target} {key}: {verdict.fingerprint} in {RELEASES}")
    edits: dict[Path, str] = {}
    if dump_releases(data) != releases_text:
        edits[releases_file] = dump_releases(data)
    if not commit:
        old = matrix_file.read_text()
        new = add_release(old, codes[0].component, codes[0].key, codes[0].python)
        if new != old:
            edits[matrix_file] = new
            say(f"add {codes[0].component} {codes[0].key} to {MATRIX_JSON}")
    if not edits:
        say("nothing to record: every fingerprint whose tests passed is recorded already")
    elif dry_run:
        say(f"--dry-run: {len(edits)} file(s) left unchanged")
    else:
        for path, text in edits.items():
            path.write_text(text)
        say(f"wrote {', '.join(str(p.relative_to(root)) for p in edits)}")
        scope = codes[0].key if not commit else ""
        say(f"next: python compat/matrix.py {scope}".rstrip() + " (check), then python compat/matrix.py --report "
            "(regenerates compat/COMPATIBILITY.md: the whole matrix)")
    return True


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="megatron-core==X.Y.Z, megatron-fsdp==X.Y.Z or megatron-lm@<commit>")
    parser.add_argument("--dry-run", action="store_true", help="print what would be recorded; change no file")
    args = parser.parse_args(argv)
    result = adopt(args.spec, dry_run=args.dry_run, say=lambda line: print(line, flush=True))
    return 0 if all(v.ok for v in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
