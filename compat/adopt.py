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
the targets it proves (``TEST_TARGETS``: by test file; test_contract by its parameter id).

A target is recorded only where at least one of its tests passed and none failed: one line in
its module's ``fingerprints={...}`` literal, in version order (a release) or keyed
``megatron_main.RELEASE`` (a commit; megatron_main.COMMIT moves to the commit only where every
applicable target passes). A release also joins compat/matrix.json. A target whose test fails
stays unverified: the test and the first line of its failure are printed.
"""

from __future__ import annotations

import argparse
import ast
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
TARGETS_DIR = ROOT / "gemm_patch" / "targets"
MAIN_MODULE = TARGETS_DIR / "megatron_main.py"
PATCHED = ("verified", "compatible", "forced")

# Which targets each test file proves. test_contract is credited by its parameter id (the
# target's name); a file not listed here credits nothing (its failures are printed, not held
# against a target).
from matrix_quick import TEST_TARGETS  # noqa: E402  (which fix each test file proves)

CONTRACT = "test_contract.py"
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
    if not found.applicable:
        return "not applicable"
    if release and target.fingerprints.get(release) == found.fingerprint:
        return "verified"
    if found.fingerprint in target.fingerprints.values():
        return "compatible"
    return "forced"


# -- the tests ------------------------------------------------------------------------------

@dataclass
class Outcome:
    file: str
    name: str
    outcome: str  # passed, failed, skipped
    message: str = ""


def credited(case: Outcome, names: list[str]) -> list[str]:
    """The targets a test proves: by its file, or test_contract's parameter id."""
    if case.file == CONTRACT:
        param = case.name.partition("[")[2].rstrip("]")
        hits = [n for n in names if param == n or param.startswith(n + "-")]
        return [max(hits, key=len)] if hits else []
    return [n for n in TEST_TARGETS.get(case.file, ()) if n in names]


def run_tests(code: Code, python: str, expected: dict[str, str], extra: dict[str, str]) -> list[Outcome]:
    env = matrix.folders_env(code.folders, expected)
    env.update(GEMM_PATCH_ALLOW_UNVERIFIED="1", GEMM_PATCH_MATRIX_QUICK="0", NO_VCS_VERSION="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT / "compat")])
    junit = matrix.CACHE / "junit" / f"adopt-{code.component}-{code.key.replace('@', '-')}.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    proc = subprocess.run([python, "-m", "pytest", *code.tests, "-q", "-p", "no:cacheprovider",
                           f"--junitxml={junit}"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=matrix.CHILD_TIMEOUT)
    outcomes = []
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            module = next((part for part in reversed(case.get("classname", "").split("."))
                           if part.startswith("test_")), "")
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                text = bad.get("message") or bad.text or "?"
                outcomes.append(Outcome(module + ".py", case.get("name", "?"), "failed",
                                        text.strip().splitlines()[0] if text.strip() else "?"))
            else:
                outcomes.append(Outcome(module + ".py", case.get("name", "?"),
                                        "skipped" if case.find("skipped") is not None else "passed"))
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


# -- editing the tables ---------------------------------------------------------------------

def _version_key(key: str) -> tuple:
    from packaging.version import InvalidVersion, Version

    if key.startswith("main@") or key == "megatron_main.RELEASE":
        return (1, Version("0"))
    try:
        return (0, Version(key))
    except InvalidVersion:
        return (0, Version("0"))


def _table(tree: ast.AST, name: str) -> ast.Dict:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            if isinstance(kw.get("name"), ast.Constant) and kw["name"].value == name:
                table = kw.get("fingerprints")
                if isinstance(table, ast.Dict):
                    return table
                raise ValueError(f"{name}: fingerprints is not a dict literal")
    raise KeyError(f"no target named {name!r} in this module")


def _entries(table: ast.Dict) -> list[tuple[list[str], str | None, ast.AST, ast.AST, ast.AST | None]]:
    """(keys, fingerprint, first node, last node, fromkeys tuple) per entry of the dict literal."""
    entries = []
    for key, value in zip(table.keys, table.values, strict=True):
        fp = value.value if isinstance(value, ast.Constant) else None
        if key is None:  # **dict.fromkeys((...), fp)
            if (isinstance(value, ast.Call) and len(value.args) == 2 and isinstance(value.args[0], ast.Tuple)
                    and isinstance(value.args[1], ast.Constant)):
                keys = [e.value for e in value.args[0].elts if isinstance(e, ast.Constant)]
                entries.append((keys, value.args[1].value, value, value, value.args[0]))
            continue
        keys = [key.value] if isinstance(key, ast.Constant) else [ast.unparse(key)]
        entries.append((keys, fp, key, value, None))
    return entries


def _offset(lines: list[str], lineno: int, col: int) -> int:
    return sum(len(line) for line in lines[:lineno - 1]) + len(lines[lineno - 1].encode()[:col].decode())


def insert_fingerprint(text: str, name: str, key: str, fp: str) -> str:
    """``text`` (a target module's source) with ``key: fp`` in target ``name``'s fingerprints
    literal: unchanged where recorded already, the value replaced where the key holds another,
    else one entry after the last key that sorts before it (releases by version, main keys
    last): a tuple member of a ``dict.fromkeys`` group of the same fingerprint, a line of its
    own in a table written one entry a line, inline in a one-line table. ``key`` is a release
    ("0.20.0") or ``megatron_main.RELEASE``."""
    tree = ast.parse(text)
    table = _table(tree, name)
    lines = text.splitlines(keepends=True)
    entries = _entries(table)
    for keys, known, _, last, group in entries:
        if key in keys:
            if known == fp:
                return text
            if group is not None:
                raise ValueError(f"{name}: {key} is recorded in a dict.fromkeys group with {known}")
            start, end = (_offset(lines, last.lineno, last.col_offset),
                          _offset(lines, last.end_lineno, last.end_col_offset))
            return text[:start] + json.dumps(fp) + text[end:]
    literal = key if key == "megatron_main.RELEASE" else json.dumps(key)
    before = [e for e in entries if max(map(_version_key, e[0]), default=(0,)) <= _version_key(key)]
    if before:
        keys, known, first, last, group = before[-1]
        if group is not None and known == fp and not key.startswith("megatron_main"):
            at = _offset(lines, group.end_lineno, group.end_col_offset) - 1  # the tuple's ")"
            return text[:at] + f", {literal}" + text[at:]
    multiline = table.lineno != table.end_lineno
    if multiline:
        if before:
            anchor = before[-1][3]
            line_no = anchor.end_lineno
        else:
            anchor = entries[0][2] if entries else None
            line_no = (anchor.lineno - 1) if anchor else table.lineno
        indent = re.match(r"\s*", lines[(anchor or table).lineno - 1]).group(0) if anchor else \
            re.match(r"\s*", lines[table.lineno - 1]).group(0) + "    "
        new = f"{indent}{literal}: {json.dumps(fp)},\n"
        return "".join(lines[:line_no]) + new + "".join(lines[line_no:])
    if before:
        at = _offset(lines, before[-1][3].end_lineno, before[-1][3].end_col_offset)
        return text[:at] + f", {literal}: {json.dumps(fp)}" + text[at:]
    at = _offset(lines, table.lineno, table.col_offset) + 1  # after "{"
    tail = ", " if entries else ""
    return text[:at] + f"{literal}: {json.dumps(fp)}{tail}" + text[at:]


def ensure_main_import(text: str) -> str:
    """The module imports megatron_main (for a ``megatron_main.RELEASE`` key), where isort puts it."""
    if re.search(r"^from \. import .*\bmegatron_main\b", text, re.M):
        return text
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("from . import ") and "(" not in line:
            names = sorted({*line[len("from . import "):].strip().split(", "), "megatron_main"})
            lines[i] = f"from . import {', '.join(names)}\n"
            return "".join(lines)
    relative = [i for i, line in enumerate(lines) if line.startswith("from .")]
    if not relative:
        raise ValueError("no relative import to place 'from . import megatron_main' beside")
    at = next((i for i in relative if re.match(r"from \.\w", lines[i])), relative[-1] + 1)
    return "".join(lines[:at]) + "from . import megatron_main\n" + "".join(lines[at:])


def _defining_file(target) -> Path:
    """The module under gemm_patch/targets/ whose source names the target."""
    for path in sorted(TARGETS_DIR.glob("*.py")):
        if f'name="{target.name}"' in path.read_text():
            return path
    raise KeyError(f"no module under gemm_patch/targets/ defines {target.name}")


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

def adopt(spec: str, dry_run: bool = False, say=print) -> dict[str, Verdict]:
    from gemm_patch.targets import REGISTRY

    start = time.perf_counter()
    codes = prepare(spec)
    by_name = {t.name: t for t in REGISTRY}
    all_verdicts: dict[str, Verdict] = {}
    edits: dict[Path, str] = {}
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
    for line in unrecorded_without_site(all_verdicts, by_name):
        say("  " + line)
    complete = all(v.ok for v in all_verdicts.values())
    commit = codes[0].commit
    if commit:
        from gemm_patch.targets import megatron_main

        moves = commit != megatron_main.COMMIT
        if moves and not complete:
            say(f"not every target passes on {commit[:8]}: nothing recorded, megatron_main.COMMIT stays "
                f"{megatron_main.COMMIT[:8]}")
            return all_verdicts
        if moves:
            edits[MAIN_MODULE] = MAIN_MODULE.read_text().replace(megatron_main.COMMIT, commit)
    for verdict in all_verdicts.values():
        if verdict.state == "not applicable" or not verdict.ok or verdict.fingerprint is None:
            continue
        target = by_name[verdict.target]
        key = "megatron_main.RELEASE" if commit else codes[0].key
        recorded = target.fingerprints.get(f"main@{commit[:8]}" if commit else key)
        if recorded == verdict.fingerprint and not (commit and commit != megatron_main.COMMIT):
            continue
        path = _defining_file(target)
        text = edits.get(path, path.read_text())
        if commit:
            text = ensure_main_import(text)
        edits[path] = insert_fingerprint(text, target.name, key, verdict.fingerprint)
        say(f"record {target.name} {key if not commit else 'main@' + commit[:8]}: {verdict.fingerprint} "
            f"in {path.relative_to(ROOT)}")
    if not commit:
        new = add_release(matrix.MATRIX_FILE.read_text(), codes[0].component, codes[0].key, codes[0].python)
        if new != matrix.MATRIX_FILE.read_text():
            edits[matrix.MATRIX_FILE] = new
            say(f"add {codes[0].component} {codes[0].key} to compat/matrix.json")
    if not edits:
        say("nothing to record: every fingerprint whose tests passed is recorded already")
    elif dry_run:
        say(f"--dry-run: {len(edits)} file(s) left unchanged")
    else:
        for path, text in edits.items():
            path.write_text(text)
        say(f"wrote {', '.join(str(p.relative_to(ROOT)) for p in edits)}")
        scope = codes[0].key if not commit else ""
        say(f"next: python compat/matrix.py {scope}".rstrip() + " (check), then python compat/matrix.py --report "
            "(regenerates compat/COMPATIBILITY.md: the whole matrix)")
    applicable = [v for v in all_verdicts.values() if v.state != "not applicable"]
    say(f"{'complete' if complete else 'partial'}: {sum(v.ok for v in applicable)} of {len(applicable)} "
        f"applicable targets pass "
        f"({time.perf_counter() - start:.0f}s)")
    return all_verdicts


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
