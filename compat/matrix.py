"""The version matrix: every release of compat/matrix.json (megatron-core, megatron-fsdp),
installed side by side under compat/.cache and tested in its own interpreter.

    python compat/matrix.py                  # every release, two at a time; one line per release
    python compat/matrix.py 0.17.1 0.6.1     # some releases (a version, a component, or component==version)
    python compat/matrix.py --report         # every release, then rewrite compat/COMPATIBILITY.md
    python compat/matrix.py --build-venv 3.12 --torch torch==2.13.0   # only the venv of Python 3.12

Each release is installed once with ``pip install --no-deps --target compat/.cache/<prefix>-X``
(reused on later runs). What each target must read on it is not written in matrix.json: it
follows from the target's fingerprint table (``Target.expected_state``), for every target of
``gemm_patch.targets.REGISTRY`` whose ``distribution`` is the release's component. A child
interpreter runs the component's tests against the release (expectations in
``GEMM_PATCH_MATRIX_EXPECT``, JSON ``{target: state}``); before its first test, that child imports
gemm_patch and the targets' modules as a fresh process does and reports ``gemm_patch.status()``
(compat/matrix_states.py). The release is the only megatron a
child sees: compat/isolate, first on its PYTHONPATH, hides a megatron-core or megatron-fsdp
installed in the interpreter's own site-packages (``release_env``).

Python: of the releases whose Requires-Python is above this interpreter (megatron-core >= 0.17
declares 3.12), the newest of each component runs in a venv of a matching interpreter
(``python3.12`` on PATH or under pyenv), built once in compat/.cache/venv-3.12 with the same torch
release: one lane per floor. The older ones run here, installed with ``--ignore-requires-python``
(their code imports and passes on 3.11), and their lines and the report say so. Why one lane:
PyPI has no CPU build of torch for Linux, so that venv downloads torch with its CUDA libraries
(several GB; torch does not import without them). ``--native`` / ``GEMM_PATCH_MATRIX_NATIVE=1``
runs every such release in its floor's venv; ``--fallback`` / ``GEMM_PATCH_MATRIX_FALLBACK=1``
runs them all here, as does a machine with no such Python.

Whole folder or quick: releases whose recorded fingerprints are identical for every target
(0.15.0-0.15.3, say) form a group; the newest of each group (in any interpreter) runs the whole
test folder, the others every test but those that start a Python process, and of a sweep (a test
repeating one check over layouts) the first layout of each check (compat/matrix_quick.py says
why). ``--full`` / ``GEMM_PATCH_MATRIX_FULL=1`` runs the whole folder everywhere.

Every run writes compat/.cache/matrix-report.md (untracked); only ``--report`` writes the
tracked compat/COMPATIBILITY.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import glob
import json
import os
import platform
import queue
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matrix_quick import COMMON_ELSEWHERE, left_elsewhere  # noqa: E402  (the matrix's pytest plugin)

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "compat" / ".cache"
MATRIX_FILE = ROOT / "compat" / "matrix.json"
REPORT = ROOT / "compat" / "COMPATIBILITY.md"
CACHE_REPORT = CACHE / "matrix-report.md"
# On a child's PYTHONPATH: its sitecustomize hides the interpreter's own megatron (release_env).
ISOLATE = ROOT / "compat" / "isolate"
JOBS = int(os.environ.get("GEMM_PATCH_MATRIX_JOBS", "2"))
CHILD_TIMEOUT = 1200  # seconds for one release's tests
# The test dependencies a venv for another interpreter gets besides torch (gemm_patch itself
# comes from the source tree on PYTHONPATH).
VENV_PACKAGES = ("numpy<2.5", "wrapt>=1.14", "packaging>=21", "pytest>=7")


@dataclass(frozen=True)
class Release:
    component: str  # distribution name: "megatron-core", "megatron-fsdp"
    version: str
    prefix: str  # cache folder prefix
    tests: str  # test folder, relative to the repository
    python: str | None = None  # Requires-Python floor above gemm-patch's own ("3.12")

    @property
    def label(self) -> str:
        return f"{self.component} {self.version}"


def load_matrix(path: Path = MATRIX_FILE) -> list[Release]:
    data = json.loads(path.read_text())
    return [Release(component, entry["version"], spec["cache"], spec["tests"], entry.get("python"))
            for component, spec in data["components"].items() for entry in spec["releases"]]


MATRIX: list[Release] = load_matrix()


def select(selectors: Sequence[str], matrix: Sequence[Release] = MATRIX) -> list[Release]:
    """Releases named by a version (``0.17.1``), a component (``megatron-fsdp``) or both
    (``megatron-fsdp==0.6.1``), in matrix order; all of them for none."""
    if not selectors:
        return list(matrix)
    chosen = []
    for selector in selectors:
        component, _, version = selector.rpartition("==")
        found = [r for r in matrix
                 if (r.component == selector) or (r.version == version and component in ("", r.component))]
        if not found:
            known = ", ".join(f"{r.component}=={r.version}" for r in matrix)
            raise SystemExit(f"{selector} is not in compat/matrix.json; known: {known}")
        chosen += [r for r in found if r not in chosen]
    return [r for r in matrix if r in chosen]


def expected_states(release: Release) -> dict[str, str]:
    """What every target of the release's component must read on it: recorded in its
    fingerprint table -> verified, absent -> not applicable."""
    from gemm_patch.targets import REGISTRY

    return {t.name: t.expected_state(release.version) for t in REGISTRY if t.distribution == release.component}


def fingerprint_key(release: Release) -> tuple:
    """What gemm_patch relies on in this release, as recorded: one fingerprint (or None) per
    target of its component."""
    from gemm_patch.targets import REGISTRY

    return tuple((t.name, t.fingerprints.get(release.version)) for t in REGISTRY if t.distribution == release.component)


def plan(releases: Sequence[Release]) -> dict[Release, Release | None]:
    """For each release, None where it runs the whole test folder, else the release of the same
    group (same component and recorded fingerprints) that does: the newest. Their interpreters
    need not agree (process_elsewhere says why); each release runs every in-process test in its own."""
    if os.environ.get("GEMM_PATCH_MATRIX_FULL") == "1":
        return {r: None for r in releases}
    groups: dict[tuple, list[Release]] = {}
    for release in releases:
        groups.setdefault((release.component, fingerprint_key(release)), []).append(release)
    return {r: (None if r is group[-1] else group[-1]) for group in groups.values() for r in group}


def process_elsewhere(releases: Sequence[Release], scope: dict[Release, Release | None]) -> dict[Release, str]:
    """For each release that runs its whole folder, the targets whose process tests run on a newer
    such release of the same component with the same fingerprint for that target, in whichever
    interpreter, and ``common`` on all but the component's newest such release (tests marked
    common_machinery) (comma-separated, for GEMM_PATCH_MATRIX_PROCESS_ELSEWHERE). The interpreter does
    not matter here: a process test checks what happens around the import (order, strict mode,
    log lines, threads) for code that is the same, and every release still runs every in-process
    test in its own interpreter."""
    from gemm_patch.targets import REGISTRY

    full = [r for r in releases if scope.get(r) is None]
    owner: dict[tuple, Release] = {}
    def key(release: Release, target) -> tuple:
        return release.component, target.name, target.fingerprints.get(release.version)

    newest: dict[str, Release] = {}
    for release in full:  # releases are listed oldest first: the newest of each key wins
        newest[release.component] = release
        for target in REGISTRY:
            if target.distribution == release.component:
                owner[key(release, target)] = release
    return {release: ",".join([t.name for t in REGISTRY if t.distribution == release.component
                               and owner[key(release, t)] is not release]
                              + ([COMMON_ELSEWHERE] if newest[release.component] is not release else []))
            for release in full}


# -- interpreters ---------------------------------------------------------------------------

def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2])


@dataclass(frozen=True)
class Interpreter:
    python: str  # executable
    version: str  # "3.12.1"
    suffix: str = ""  # cache folder suffix for releases installed with it ("" for this one)
    fallback: str = ""  # non-empty: why a release runs here with --ignore-requires-python

    def describe(self) -> str:
        if self.fallback:
            return f"Python {self.version} with --ignore-requires-python ({self.fallback})"
        return f"Python {self.version}"


HERE = Interpreter(sys.executable, platform.python_version())


def find_python(minor: str) -> str | None:
    """An interpreter of Python ``minor`` ("3.12"): ``python3.12`` on PATH, else under pyenv."""
    roots = [os.environ.get("PYENV_ROOT", ""), os.path.expanduser("~/.pyenv"), "/root/.pyenv"]
    candidates = [shutil.which(f"python{minor}") or ""]
    for root in filter(None, roots):
        candidates += sorted(glob.glob(os.path.join(root, "versions", f"{minor}.*", "bin", f"python{minor}")),
                             reverse=True)
    for candidate in filter(None, dict.fromkeys(candidates)):
        try:
            out = subprocess.run([candidate, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == minor:
            return candidate
    return None


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """An exclusive lock over compat/.cache/<name> (other threads and other processes, such as
    a second pytest in the same tree, wait for the install in progress)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# The torch release a venv for another interpreter gets: this interpreter's, unless given
# (``--build-venv`` from an interpreter without torch, as .ci/run starts it before its own venv).
TORCH_PIN: str | None = None


def _torch_pin() -> str:
    if TORCH_PIN:
        return TORCH_PIN
    try:
        return "torch==" + metadata.version("torch").split("+")[0]
    except metadata.PackageNotFoundError:
        return "torch"


def ensure_venv(minor: str) -> Interpreter:
    """A venv of Python ``minor`` in compat/.cache/venv-<minor> with this interpreter's torch
    release and the test dependencies, built once. Returns a fallback Interpreter (this one,
    with the reason) where no such Python exists or the venv cannot be built."""
    if os.environ.get("GEMM_PATCH_MATRIX_FALLBACK") == "1":
        return Interpreter(HERE.python, HERE.version, fallback=f"declares >={minor}; GEMM_PATCH_MATRIX_FALLBACK=1")
    venv = CACHE / f"venv-{minor}"
    python = venv / "bin" / "python"
    marker = venv / ".complete"
    with _locked(f"venv-{minor}"):
        if not marker.exists():
            base = find_python(minor)
            if base is None:
                return Interpreter(HERE.python, HERE.version, fallback=f"declares >={minor}; no Python {minor} found")
            packages = [_torch_pin(), *VENV_PACKAGES]
            steps = [[base, "-m", "venv", "--clear", str(venv)],
                     [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *packages]]
            for cmd in steps:
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["?"]
                    return Interpreter(HERE.python, HERE.version,
                                       fallback=f"declares >={minor}; building {venv.name} failed: {tail[0]}")
            marker.write_text(" ".join(packages) + "\n")
    version = subprocess.run([str(python), "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True).stdout.strip()
    return Interpreter(str(python), version, suffix=f"-py{minor}")


# -- one release ----------------------------------------------------------------------------

def ensure_release(release: Release, interpreter: Interpreter = HERE) -> Path:
    """Install the release (without dependencies) into its own folder, once per interpreter."""
    target = CACHE / f"{release.prefix}-{release.version}{interpreter.suffix}"
    marker = target / ".complete"
    if marker.exists():
        return target
    with _locked(target.name):
        if marker.exists():
            return target
        shutil.rmtree(target, ignore_errors=True)
        # pip compiles every module here: a process that imports megatron then reads .pyc files,
        # also where PYTHONDONTWRITEBYTECODE=1 keeps Python from writing them itself
        cmd = [interpreter.python, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
               "--target", str(target), f"{release.component}=={release.version}"]
        if interpreter.fallback or (release.python and _version_tuple(interpreter.version) < _version_tuple(
                release.python)):
            cmd.insert(4, "--ignore-requires-python")
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        marker.write_text(release.version)
    return target


def release_env(release: Release | str, interpreter: Interpreter = HERE) -> dict[str, str]:
    """Environment for a child interpreter that imports this release and gemm_patch from the
    source tree, with the expected states in GEMM_PATCH_MATRIX_EXPECT (a caller's own
    GEMM_PATCH_* settings are dropped). A bare version means that release of the matrix, run
    by this interpreter.

    The release is the only megatron the child sees: compat/isolate (its ``sitecustomize``)
    comes first on PYTHONPATH and hides any megatron-core or megatron-fsdp of the
    interpreter's own site-packages, from ``import`` and from ``importlib.metadata`` alike (a
    venv with megatron-core installed, as the README's demo makes, would otherwise leak it into
    every release's tests), and the caller's PYTHONPATH entries that hold one are dropped."""
    if isinstance(release, str):
        release = select([release])[0]
    return folders_env([ensure_release(release, interpreter)], expected_states(release))


def folders_env(folders: Sequence[Path], expected: dict[str, str]) -> dict[str, str]:
    """``release_env`` for megatron installed in ``folders`` (first on the path after
    compat/isolate) and the expected states given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH")}
    path = [str(ISOLATE), *map(str, folders), str(ROOT)]
    path += [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and not holds_megatron(entry)]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["GEMM_PATCH_MATRIX_EXPECT"] = json.dumps(expected)
    env["PYTHONWARNINGS"] = "ignore"
    return env


def holds_megatron(entry: str) -> bool:
    """Whether a sys.path entry holds a megatron package or distribution of its own."""
    folder = Path(entry)
    return any((folder / name).exists() or any(folder.glob(f"{name}-*.dist-info"))
               for name in ("megatron", "megatron_core", "megatron_fsdp"))


@dataclass
class ReleaseResult:
    release: Release
    interpreter: Interpreter
    expected: dict[str, str]
    states: dict[str, str] = field(default_factory=dict)
    found_version: str | None = None
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    install_seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    full_on: Release | None = None  # quick run: the release of its group that runs every test
    left: tuple[int, int] = (0, 0)  # (process tests, layouts of sweeps) this run left to another release

    @property
    def ok(self) -> bool:
        return (self.failed == 0 and self.passed > 0 and self.states == self.expected
                and (self.found_version or "").split("+")[0] == self.release.version)

    def line(self) -> str:
        states = ", ".join(f"{name} {state}" + ("" if state == self.expected.get(name)
                                                 else f" (expected {self.expected.get(name)})")
                           for name, state in self.states.items()) or "no states"
        missing = [n for n in self.expected if n not in self.states]
        if missing:
            states += f"; missing {', '.join(missing)}"
        return (f"{self.release.label:<21} {'ok  ' if self.ok else 'FAIL'} {self.interpreter.describe()}: "
                f"{states}; {self.passed} passed, {self.failed} failed, {self.skipped} skipped{self.scope()} "
                f"({self.seconds:.0f}s{f', install {self.install_seconds:.0f}s' if self.install_seconds >= 1 else ''})")

    def scope(self) -> str:
        if self.full_on is None:
            return ""
        processes, layouts = self.left
        return (f", {processes} process tests and {layouts} layouts of sweeps left to {self.full_on.version} "
                "(same code)")


def run_release(release: Release | str, interpreter: Interpreter | None = None,
                full_on: Release | None = None, extra_args: Sequence[str] = (), elsewhere: str = "") -> ReleaseResult:
    """Install the release, run its component's tests against it (all of them, or with
    ``full_on`` those that start no process) and read the states of a fresh import: in the tests'
    process before its first test (compat/matrix_states.py), else in a process of their own."""
    import matrix_states  # with pytest, which the matrix's own interpreter has
    if isinstance(release, str):
        release = select([release])[0]
    if interpreter is None:
        interpreter = lane(release)
    result = ReleaseResult(release, interpreter, expected_states(release), full_on=full_on)
    start = time.perf_counter()
    try:
        env = release_env(release, interpreter)
    except subprocess.CalledProcessError as exc:
        result.failed, result.seconds = 1, time.perf_counter() - start
        result.failures.append(f"pip install failed: {(exc.stderr or '').strip()[-1500:]}")
        return result
    result.install_seconds = time.perf_counter() - start
    junit = CACHE / "junit" / f"{release.prefix}-{release.version}{interpreter.suffix}.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    states_file = junit.with_suffix(".states.json")
    states_file.unlink(missing_ok=True)
    test_env = {**env, "PYTHONPATH": os.pathsep.join([env["PYTHONPATH"], str(ROOT / "compat")]),
                "GEMM_PATCH_MATRIX_QUICK": "1" if full_on else "0", "GEMM_PATCH_MATRIX_PROCESS_ELSEWHERE": elsewhere,
                matrix_states.STATES_ENV: str(states_file),
                matrix_states.NAMES_ENV: f"{release.component}:{','.join(result.expected)}"}
    try:
        proc = subprocess.run(
            [interpreter.python, "-m", "pytest", str(ROOT / release.tests), "-q", "-p", "no:cacheprovider",
             "-p", "matrix_quick", "-p", "matrix_states", "-p", "peak_memory", f"--junitxml={junit}", *extra_args],
            env=test_env, cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
        output = proc.stdout[-2000:] + proc.stderr[-2000:]
        returncode = proc.returncode
        result.left = left_elsewhere(proc.stdout)
    except subprocess.TimeoutExpired:
        output, returncode = f"tests ran past {CHILD_TIMEOUT}s", -1
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                result.failed += 1
                result.failures.append(f"{case.get('classname', '')}::{case.get('name', '?')}")
            elif case.find("skipped") is not None:
                result.skipped += 1
            else:
                result.passed += 1
    if returncode != 0 and not result.failures:
        result.failed += 1
        result.failures.append(output)
    if states_file.exists():
        found = json.loads(states_file.read_text())
        states_file.unlink()
    else:  # pytest ended before its first hook: a process of their own
        probe = subprocess.run([interpreter.python, "-c", matrix_states.PROBE, release.component,
                                ",".join(result.expected)], env=test_env, cwd=ROOT, capture_output=True, text=True,
                               timeout=600)
        try:
            found = json.loads(probe.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            found = {"error": probe.stderr.strip()[-1500:]}
    if "error" in found:
        result.failures.append(f"state probe failed: {found['error']}")
    else:
        result.states, result.found_version = found["states"], found["version"]
    result.seconds = time.perf_counter() - start
    return result


# -- the whole matrix -----------------------------------------------------------------------

_venvs: dict[str, Interpreter] = {}
_venvs_lock = threading.Lock()


def in_floor_lane(release: Release) -> bool:
    """Whether the matrix runs this release in a venv of its Requires-Python floor (above this
    interpreter): the newest release of its component with that floor, a release the matrix does
    not list (compat/adopt.py's), or every one with GEMM_PATCH_MATRIX_NATIVE=1."""
    if not release.python or _version_tuple(HERE.version) >= _version_tuple(release.python):
        return False
    same_floor = [r for r in MATRIX if r.component == release.component and r.python == release.python]
    return os.environ.get("GEMM_PATCH_MATRIX_NATIVE") == "1" or release not in same_floor or release == same_floor[-1]


def lane(release: Release) -> Interpreter:
    """The interpreter the matrix runs a release in: its floor's venv where ``in_floor_lane``,
    else this one (installed with --ignore-requires-python where it declares a newer Python)."""
    if in_floor_lane(release) or not release.python or _version_tuple(HERE.version) >= _version_tuple(
            release.python):
        return interpreter_for(release)
    newest = [r.version for r in MATRIX if r.component == release.component and r.python == release.python][-1]
    return Interpreter(HERE.python, HERE.version,
                       fallback=f"declares >={release.python}; {release.component} {newest} runs on {release.python}")


def interpreter_for(release: Release) -> Interpreter:
    """This interpreter where it satisfies the release's Requires-Python, else the venv of the
    release's floor (built on first use), else this one as a reported fallback."""
    if not release.python or _version_tuple(HERE.version) >= _version_tuple(release.python):
        return HERE
    with _venvs_lock:
        if release.python not in _venvs:
            _venvs[release.python] = ensure_venv(release.python)
        return _venvs[release.python]


def run_matrix(releases: Sequence[Release], jobs: int = JOBS,
               note: Callable[[str], None] = lambda line: None) -> Iterator[ReleaseResult]:
    """Run the releases ``jobs`` at a time and yield each result as it finishes. Venvs for
    other interpreters are built in the background meanwhile (mostly download and unpacking);
    their releases start once theirs is ready, the others fill the workers until then."""
    scope = plan(releases)
    elsewhere = process_elsewhere(releases, scope)
    # Longest first, so that the two workers finish together: whole folders, then quick runs;
    # megatron-core before megatron-fsdp; newest first (a newer release has more applicable
    # targets, and the newest whole folder runs the common process tests too: the longest run of
    # all, which started last would run on alone at the end). A release waiting for its venv is
    # passed over until the venv is ready, then taken next.
    order = {release: n for n, release in enumerate(releases)}
    pending = sorted(releases, key=lambda r: (scope[r] is not None, r.component != "megatron-core", -order[r]))
    floors = sorted({r.python for r in pending if in_floor_lane(r)})
    ready: dict[str | None, Interpreter] = {}
    cond = threading.Condition()
    done: queue.Queue = queue.Queue()

    def build(minor: str) -> None:
        start = time.perf_counter()
        if not (CACHE / f"venv-{minor}" / ".complete").exists():
            done.put(f"Python {minor} for the matrix: building compat/.cache/venv-{minor} in the background "
                     f"({_torch_pin()}; its releases start when it is ready)")
        try:
            interpreter = interpreter_for(Release("", "", "", "", minor))
        except Exception as exc:  # noqa: BLE001 (a broken venv must not hang the matrix)
            interpreter = Interpreter(HERE.python, HERE.version, fallback=f"declares >={minor}; {exc}")
        done.put(f"Python {minor} for the matrix: {interpreter.describe()} "
                 f"[{interpreter.python}] ({time.perf_counter() - start:.0f}s)")
        with cond:
            ready[minor] = interpreter
            cond.notify_all()

    def take() -> tuple[Release, Interpreter, Release | None] | None:
        with cond:
            while pending:
                for release in pending:
                    floor = release.python if in_floor_lane(release) else None
                    if floor is None or floor in ready:
                        pending.remove(release)
                        return release, (ready[floor] if floor else lane(release)), scope[release]
                cond.wait()
            return None

    def worker() -> None:
        while (job := take()) is not None:
            try:
                done.put(run_release(*job, elsewhere=elsewhere.get(job[0], "")))
            except Exception as exc:  # noqa: BLE001
                failed = ReleaseResult(job[0], job[1], {}, failed=1, failures=[repr(exc)], full_on=job[2])
                done.put(failed)

    threads = [threading.Thread(target=build, args=(minor,), daemon=True) for minor in floors]
    threads += [threading.Thread(target=worker, daemon=True) for _ in range(max(1, jobs))]
    for thread in threads:
        thread.start()
    remaining = len(releases)
    while remaining:
        item = done.get()
        if isinstance(item, str):
            note(item)
            continue
        remaining -= 1
        yield item


def render_report(results: Sequence[ReleaseResult], wall: float | None = None) -> str:
    import gemm_patch

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "?"
    interpreters = sorted({r.interpreter.describe() for r in results})
    lines = [
        "# Compatibility report",
        "",
        "Generated by `python compat/matrix.py --report` (the whole matrix of compat/matrix.json); "
        "do not edit. Expected states follow from each target's fingerprint table.",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- gemm-patch {gemm_patch.__version__}, torch {torch_version} here, {platform.machine()}, CPU only",
        f"- interpreters: {'; '.join(interpreters)}",
        *([f"- wall time: {wall:.0f} s ({JOBS} at a time)"] if wall is not None else []),
        "- megatron-core (tests/megatron): unpatched crash reproduced, patched fp32 main_grad against fp64, "
        "bitwise forward/dgrad/bf16 main_grad, revert by identity, import order, strict mode; apex stand-in "
        "through megatron's own constructors; Megatron-FSDP's own all_gather_and_wait_parameters_ready "
        "through the fsdp-te-overwrite wrapper",
        "- megatron-fsdp (tests/megatron_fsdp): the standalone `megatron_fsdp.megatron_fsdp` imported, "
        "its own all_gather_and_wait_parameters_ready through the mfsdp-te-overwrite wrapper, revert by "
        "identity, the switch, the summary line",
        "- process tests: a release whose recorded fingerprints equal those of a newer release of the "
        "matrix runs every test but those that start a Python process, and of each sweep (a test marked "
        "sweep: one check over layouts) the first layout of each check; that newer "
        "release runs them. A whole-folder release leaves a fix's process tests to a newer one with the "
        "same code for that fix, and the common ones (marked common_machinery) to the newest",
        "",
        "| component | release | Python | target states (expected where different) "
        "| passed | failed | skipped | process tests | time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        states = ", ".join(f"{n}: {s}" + ("" if s == r.expected.get(n) else f" (expected {r.expected.get(n)})")
                           for n, s in r.states.items()) or "?"
        lines.append(f"| {r.release.component} | {r.release.version} | {r.interpreter.describe()} | {states} | "
                     f"{r.passed} | {r.failed} | {r.skipped} | "
                     f"{f'on {r.full_on.version} (same code)' if r.full_on else 'run'} | {r.seconds:.0f} |")
    failures = [f"- {r.release.label}: {', '.join(r.failures)}" for r in results if r.failures]
    if failures:
        lines += ["", "## Failures", "", *failures]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("releases", nargs="*", help="version, component or component==version (default: all)")
    parser.add_argument("--report", action="store_true", help="also rewrite compat/COMPATIBILITY.md")
    parser.add_argument("--jobs", type=int, default=JOBS, help=f"releases at a time (default {JOBS})")
    parser.add_argument("--full", action="store_true", help="every test on every release (no quick runs)")
    parser.add_argument("--fallback", action="store_true",
                        help="run every release declaring a newer Python here, with --ignore-requires-python")
    parser.add_argument("--native", action="store_true",
                        help="run every release declaring a newer Python in a venv of it (not only the newest)")
    parser.add_argument("--build-venv", metavar="MINOR",
                        help="only build compat/.cache/venv-MINOR (3.12), as the matrix would, and exit")
    parser.add_argument("--torch", metavar="REQUIREMENT",
                        help="the torch a venv gets (default: this interpreter's release)")
    args = parser.parse_args(argv)
    if args.torch:
        global TORCH_PIN
        TORCH_PIN = args.torch
    if args.build_venv:
        interpreter = ensure_venv(args.build_venv)
        print(f"Python {args.build_venv} for the matrix: {interpreter.describe()} [{interpreter.python}]")
        return 1 if interpreter.fallback else 0
    if args.fallback:
        os.environ["GEMM_PATCH_MATRIX_FALLBACK"] = "1"
    if args.native:
        os.environ["GEMM_PATCH_MATRIX_NATIVE"] = "1"
    if args.full:
        os.environ["GEMM_PATCH_MATRIX_FULL"] = "1"
    releases = select(args.releases)
    if args.report and len(releases) != len(MATRIX):
        parser.error("--report needs the whole matrix (no release arguments)")
    start = time.perf_counter()
    results = {}
    for result in run_matrix(releases, args.jobs, note=lambda line: print(line, flush=True)):
        results[result.release] = result
        print(result.line(), flush=True)
        for failure in result.failures:
            print("    " + failure.replace("\n", "\n    "), flush=True)
    wall = time.perf_counter() - start
    ordered = [results[r] for r in releases]
    text = render_report(ordered, wall)
    CACHE_REPORT.write_text(text)
    written = [CACHE_REPORT]
    if args.report:
        REPORT.write_text(text)
        written.append(REPORT)
    ok = sum(r.ok for r in ordered)
    names = ", ".join(str(p.relative_to(ROOT)) for p in written)
    print(f"{ok}/{len(ordered)} releases ok in {wall:.0f}s; wrote {names}")
    return 0 if ok == len(ordered) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
