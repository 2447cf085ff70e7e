"""compat/adopt.py: the data edits, the test-to-target credit, a fake release adopted into a copy
of the repository (only data files change), and real adoptions against megatron-core 0.16.1
(installed under compat/.cache by the version matrix on first use).

By default one real adoption of 0.16.1 runs with one test file (fsdp-wgrad's accumulate tests,
seconds): the install, the fingerprints, the tests' outcomes read from junit and the verdicts are
the real ones. The whole tests/megatron folder (a few minutes each: the recorded release, and the
refusal of a deliberately broken copy) runs with GEMM_PATCH_ADOPT_HEAVY=1.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "compat"))
import adopt  # noqa: E402

heavy = pytest.mark.skipif(os.environ.get("GEMM_PATCH_ADOPT_HEAVY") != "1",
                           reason="a second tests/megatron run: set GEMM_PATCH_ADOPT_HEAVY=1")

def test_a_release_goes_in_version_order_and_main_stays_last():
    table = {"0.14.0": "aaaa", "0.16.0": "bbbb", "main@12345678": "bbbb"}
    adopt.set_fingerprint(table, "0.15.1", "ffff")
    assert list(table) == ["0.14.0", "0.15.1", "0.16.0", "main@12345678"]
    adopt.set_fingerprint(table, "0.17.0", "ffff")
    assert list(table)[-2:] == ["0.17.0", "main@12345678"]
    adopt.set_fingerprint(table, "0.16.0", "9999")
    assert table["0.16.0"] == "9999" and len(table) == 5


def test_moving_main_renames_every_main_key():
    data = {"megatron_main": {"commit": "1" * 40},
            "targets": {"a": {"fingerprints": {"0.19.2": "aaaa", "main@11111111": "bbbb"}},
                        "b": {"fingerprints": {"0.19.2": "cccc"}}}}
    adopt.move_main(data, "2" * 40)
    assert data["megatron_main"]["commit"] == "2" * 40
    assert data["targets"]["a"]["fingerprints"] == {"0.19.2": "aaaa", "main@22222222": "bbbb"}
    assert data["targets"]["b"]["fingerprints"] == {"0.19.2": "cccc"}


def test_matrix_json_gains_the_release_in_order():
    text = (ROOT / "compat" / "matrix.json").read_text()
    out = adopt.add_release(text, "megatron-fsdp", "0.5.2", None)
    import json

    versions = [r["version"] for r in json.loads(out)["components"]["megatron-fsdp"]["releases"]]
    assert versions.index("0.5.2") == versions.index("0.5.1") + 1
    out = adopt.add_release(text, "megatron-core", "0.20.0", "3.12")
    core = json.loads(out)["components"]["megatron-core"]["releases"]
    assert core[-1] == {"version": "0.20.0", "python": "3.12"}
    assert adopt.add_release(text, "megatron-core", "0.16.1", None) == text


def test_tests_are_credited_to_the_targets_their_marker_names():
    names = ["fsdp-wgrad", "fsdp-shared-grad"]
    case = adopt.Outcome
    assert adopt.credited(case("test_fine_grained_gather.py", "test_x", "passed",
                               proves=("fsdp-wgrad", "fsdp-shared-grad", "mfsdp-shared-grad")), names) == \
        ["fsdp-wgrad", "fsdp-shared-grad"]
    assert adopt.credited(case("test_summary_lines.py", "test_x", "passed"), names) == []


def test_a_failed_test_leaves_its_target_unverified():
    found = {"t": adopt.Found("t", "abcd", True), "u": adopt.Found("u", "ef01", True)}
    outcomes = [adopt.Outcome("test_contract.py", "test_a[t]", "passed", proves=("t",)),
                adopt.Outcome("test_contract.py", "test_b[t]", "failed", "AssertionError: twice", ("t",)),
                adopt.Outcome("test_contract.py", "test_a[u]", "passed", proves=("u",))]
    result = adopt.verdicts(found, {"t": "forced", "u": "forced"}, outcomes)
    assert not result["t"].ok and "test_b[t]: AssertionError: twice" in result["t"].line()
    assert result["u"].ok


# -- real adoptions ---------------------------------------------------------------------------

def _is_work_tree_top(root: Path) -> bool:
    out = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
    return out.returncode == 0 and Path(out.stdout.strip()).resolve() == root.resolve()


def _project_files(root: Path = ROOT) -> list[str]:
    """The files of the project at ``root``, relative to it: what git tracks there and what is
    untracked but not ignored (never a venv, the release cache or another ignored folder, however
    large). A tree outside git (an unpacked sdist) gives every file but those of git, bytecode,
    the release cache and any folder holding a venv."""
    if _is_work_tree_top(root):
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, check=True).stdout.decode().split("\0")
        # a tracked file deleted from the work tree is listed too: it is no file of the tree
        return sorted(name for name in listed if name and (root / name).is_file())
    found = []
    for folder, subfolders, names in os.walk(root):
        here = Path(folder)
        subfolders[:] = [d for d in subfolders if d not in (".git", "__pycache__", ".pytest_cache")
                         and here / d != root / "compat" / ".cache" and not (here / d / "pyvenv.cfg").exists()]
        found += [(here / n).relative_to(root).as_posix() for n in names]
    return sorted(found)


def _digest(path: Path) -> str:
    """The file's SHA-256, read a chunk at a time (a large file never lies in memory whole)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _snapshot(root: Path = ROOT) -> dict[Path, str]:
    """The digest of every project file at ``root`` (``_project_files``)."""
    return {Path(name): _digest(root / name) for name in _project_files(root)}


def test_a_snapshot_reads_no_ignored_folder_and_holds_no_file_whole(tmp_path):
    """A clone holding a large venv (ignored, as the README's demo leaves it) and a large untracked
    file: the venv is neither listed nor read, the untracked file is listed by its digest, and
    the snapshot's memory stays far below either."""
    import tracemalloc

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text(".venv/\n")
    (tmp_path / "module.py").write_text("x = 1\n")
    large = 48 << 20
    for n in range(4):
        venv_file = tmp_path / ".venv" / "lib" / f"libbig{n}.so"
        venv_file.parent.mkdir(parents=True, exist_ok=True)
        with open(venv_file, "wb") as handle:
            handle.truncate(large)  # sparse: no disk, but every byte is read back
    with open(tmp_path / "checkpoint.pt", "wb") as handle:
        handle.truncate(large)
    tracemalloc.start()
    try:
        snapshot = _snapshot(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert set(snapshot) == {Path(".gitignore"), Path("module.py"), Path("checkpoint.pt")}, sorted(snapshot)
    assert snapshot[Path("checkpoint.pt")] == _digest(tmp_path / "checkpoint.pt")
    assert peak < 8 << 20, f"the snapshot held {peak} bytes at its peak"


def test_adopting_a_new_release_changes_only_data_files(tmp_path, monkeypatch):
    """A fake megatron-core 0.19.3 adopted into a copy of the repository: its measurements are
    given (fingerprints, test outcomes), everything from the verdicts on is adopt's own. Only
    the release data and compat/matrix.json change, each by the lines of the new release."""
    from gemm_patch.engine import release_data
    from gemm_patch.targets import REGISTRY

    copy = tmp_path / "repo"
    for name in _project_files(ROOT):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / name)
    core = [t for t in REGISTRY if t.distribution == "megatron-core"]
    fresh = "0123456789abcdef"  # fsdp-wgrad's code changed; every other target's is 0.19.2's
    found = {t.name: adopt.Found(t.name, fresh if t.name == "fsdp-wgrad" else t.fingerprints.get("0.19.2"),
                                 "0.19.2" in t.fingerprints or t.name == "fsdp-wgrad") for t in core}
    outcomes = [adopt.Outcome("test_contract.py", f"test_apply_revert_apply[{t.name}]", "passed", proves=(t.name,))
                for t in core]
    monkeypatch.setattr(adopt, "prepare", lambda spec: [adopt.Code("megatron-core", "0.19.3", [], ["tests/megatron"],
                                                                   "3.12")])
    monkeypatch.setattr(adopt, "interpreter", lambda code: adopt.matrix.HERE)
    monkeypatch.setattr(adopt, "fingerprints", lambda code, python: found)
    monkeypatch.setattr(adopt, "run_tests", lambda code, python, expected, extra: outcomes)
    releases_file, matrix_file = copy / "gemm_patch/engine/releases.json", copy / "compat/matrix.json"
    releases_before = releases_file.read_text()
    before = _snapshot(copy)
    lines: list[str] = []
    result = adopt.adopt("megatron-core==0.19.3", say=lines.append, root=copy)
    after = _snapshot(copy)
    changed = {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}
    assert changed == {releases_file.relative_to(copy), matrix_file.relative_to(copy)}, (changed, lines)
    assert result["fsdp-wgrad"].state == "forced" and result["fsdp-wgrad"].ok, lines
    data = json.loads(releases_file.read_text())
    for target in core:
        table = data["targets"][target.name]["fingerprints"]
        assert table.get("0.19.3") == found[target.name].fingerprint if found[target.name].applicable \
            else "0.19.3" not in table, target.name
        assert list(table) == sorted(table, key=adopt._version_key), target.name
    diff = [line for line in difflib.ndiff(releases_before.splitlines(), releases_file.read_text().splitlines())
            if line[:1] in "+-"]
    new = [line for line in diff if '"0.19.3"' in line]
    assert len(new) == sum(found[t.name].applicable for t in core) and all(line[0] == "+" for line in new), diff
    # Beside the new lines, only a comma where a new release became the last one of its table.
    rest = [line for line in diff if line not in new]
    assert [line[2:] + "," for line in rest if line[0] == "-"] == [line[2:] for line in rest if line[0] == "+"], diff
    releases = json.loads(matrix_file.read_text())["components"]["megatron-core"]["releases"]
    assert releases[-1] == {"version": "0.19.3", "python": "3.12"}
    assert dict(release_data.load()["targets"]["fsdp-wgrad"]["fingerprints"]).get("0.19.3") is None  # ours untouched


def test_adopting_a_recorded_release_with_one_test_file(monkeypatch):
    """The recorded release, its tests cut to one file: every fingerprint is the recorded one,
    fsdp-wgrad passes its tests there, nothing is written."""
    from gemm_patch.targets import REGISTRY

    real_prepare = adopt.prepare

    def prepare(spec):
        return [dataclasses.replace(c, tests=["tests/megatron/test_fsdp_accumulate.py"]) for c in real_prepare(spec)]

    monkeypatch.setattr(adopt, "prepare", prepare)
    before = _snapshot()
    lines: list[str] = []
    result = adopt.adopt("megatron-core==0.16.1", dry_run=True, say=lines.append)
    assert _snapshot() == before, "\n".join(lines)
    for target in REGISTRY:
        if target.distribution == "megatron-core" and "0.16.1" in target.fingerprints:
            assert result[target.name].fingerprint == target.fingerprints["0.16.1"], result[target.name].line()
    assert result["fsdp-wgrad"].ok and result["fsdp-wgrad"].state == "verified", "\n".join(lines)


@heavy
def test_adopting_a_recorded_release_reproduces_its_fingerprints_and_changes_nothing():
    from gemm_patch.targets import REGISTRY

    before = _snapshot()
    lines: list[str] = []
    result = adopt.adopt("megatron-core==0.16.1", say=lines.append)
    assert _snapshot() == before, "\n".join(lines)
    for target in REGISTRY:
        if target.distribution != "megatron-core":
            continue
        verdict = result[target.name]
        if "0.16.1" in target.fingerprints:
            assert verdict.fingerprint == target.fingerprints["0.16.1"], verdict.line()
            assert verdict.ok and verdict.state == "verified", "\n".join(lines)
        else:
            assert verdict.state == "not applicable", verdict.line()
    assert any("nothing to record" in line for line in lines), lines


@heavy
def test_an_overwriting_copy_is_refused_for_the_affected_target(tmp_path, monkeypatch):
    """0.16.1 with a second, overwriting write after the fused wgrad call site in layers.py:
    fsdp-wgrad's fingerprint changes, its tests run it forced and find the persistent buffer
    overwritten; it is refused, naming the test, and nothing is recorded. The tied-weight tests
    (fsdp-shared-grad's) go through the same write, the output layer's: they fail too and are
    held against fsdp-wgrad as well; a fix whose tests do not touch that write keeps its verdict."""
    import matrix

    source = matrix.ensure_release(matrix.select(["megatron-core==0.16.1"])[0])
    copy = tmp_path / "mcore-edited"
    shutil.copytree(source, copy, symlinks=True)
    layers = copy / "megatron/core/tensor_parallel/layers.py"
    call = "torch.matmul(grad_output.t(), total_input, out=weight.main_grad)\n"
    text = layers.read_text()
    at = text.index(call) + len(call)
    indent = text[:at].splitlines()[-1].split("torch")[0]
    layers.write_text(text[:at] + f"{indent}weight.main_grad.copy_(torch.matmul(grad_output.t(), total_input))\n"
                      + text[at:])

    def prepare(spec):
        return [adopt.Code("megatron-core", "0.16.1", [copy], ["tests/megatron"])]

    monkeypatch.setattr(adopt, "prepare", prepare)
    before = _snapshot()
    lines: list[str] = []
    result = adopt.adopt("megatron-core==0.16.1", dry_run=True, say=lines.append)
    assert _snapshot() == before
    wgrad = result["fsdp-wgrad"]
    assert wgrad.state == "forced" and not wgrad.ok and wgrad.failures, wgrad.line()
    assert any(f.file == "test_fsdp_accumulate.py" for f in wgrad.failures), wgrad.line()
    assert any("fsdp-wgrad" in line and "left unverified" in line and "::" in line for line in lines), lines
    shared = result["fsdp-shared-grad"]
    assert {f.file for f in shared.failures} <= {f.file for f in wgrad.failures}, (shared.line(), wgrad.line())
    assert result["fsdp-one-rank-scale"].ok, result["fsdp-one-rank-scale"].line()


def test_code_without_the_site_that_nothing_records_is_named():
    """Not applicable in the adoption run (gate open), unverified in the matrix: said, so that the
    code is checked and recorded in the target's not_applicable table."""
    from gemm_patch.targets import REGISTRY

    by_name = {t.name: t for t in REGISTRY}
    found = {
        "fsdp-te-overwrite": adopt.Verdict("fsdp-te-overwrite", "not applicable", "3bdddaa008f6fa19"),  # 0.14.0's
        "fsdp-wgrad-gemm": adopt.Verdict("fsdp-wgrad-gemm", "not applicable", "7ec854ca9d6a137e"),  # fsdp-wgrad's
        "moe-te-overwrite": adopt.Verdict("moe-te-overwrite", "not applicable", None),  # no such function
        "fsdp-wgrad": adopt.Verdict("fsdp-wgrad", "forced", "00000000000000aa", passed=3),  # recorded now
        "fsdp-te-overwrite-by-strategy": adopt.Verdict("fsdp-te-overwrite-by-strategy", "not applicable",
                                                       "00000000000000bb"),
        "fsdp-shared-grad": adopt.Verdict("fsdp-shared-grad", "not applicable", "00000000000000aa"),
    }
    lines = adopt.unrecorded_without_site(found, by_name)
    assert len(lines) == 1 and lines[0].startswith("fsdp-te-overwrite-by-strategy: its code (00000000000000bb)"), lines
