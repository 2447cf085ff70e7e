"""An installed gemm-patch with files damaged or gone (a half-removed package, an edited or
truncated file), in venvs of their own with the real wheel installed: a training script's
``import gemm_patch`` never raises outside strict mode, ``gemm-patch status`` exits 1 with one
line naming the file, and a ``GEMM_PATCH_AUTO`` install that lost its start-up module prints at
most one line, not ``site``'s traceback, in every interpreter."""

from __future__ import annotations

import json

import pytest

pytest.register_assert_rewrite("wheel_venvs")  # a plugin (pytest_plugins), imported here first
from wheel_venvs import _site_packages, env_for, run, venv_with  # noqa: E402

pytest_plugins = ["wheel_venvs"]  # the ``wheel`` fixture, built once per run

# releases.json's damage -> what the one line must say is wrong.
DAMAGE = {
    "missing": (None, "cannot be read"),
    "truncated": (lambda text: text[: len(text) // 2], "is not valid JSON"),
    "wrong type": (lambda text: "[]", "holds a JSON list, not an object"),
    "targets wrong type": (lambda text: json.dumps({**json.loads(text), "targets": []}), "has no 'targets' object"),
    "entry missing": (lambda text: json.dumps({**json.loads(text), "targets": {
        k: v for k, v in json.loads(text)["targets"].items() if k != "fsdp-wgrad"}}),
        "has no entry for target 'fsdp-wgrad'"),
}
TRAINING_SCRIPT = """
import gemm_patch, megatron.core.tensor_parallel.layers as L
backward = vars(L.LinearWithGradAccumulationAndAsyncCommunication)["backward"]
print("PATCHED", getattr(backward, "_self_gemm_patch_target", None) is not None, gemm_patch.status().applied)
"""


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """A venv of this module's own with the wheel installed: (python, its releases.json)."""
    python = venv_with(wheel, tmp_path_factory.mktemp("damaged") / "venv")
    return python, _site_packages(python) / "gemm_patch" / "engine" / "releases.json"


@pytest.fixture(params=list(DAMAGE))
def damaged(installed, request):
    python, path = installed
    text = path.read_text()
    change, what = DAMAGE[request.param]
    if change is None:
        path.unlink()
    else:
        path.write_text(change(text))
    yield python, what
    path.write_text(text)


def only_line_about_releases(stderr: str, what: str) -> str:
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    assert "releases.json" in lines[0] and what in lines[0] and "reinstall gemm-patch" in lines[0], lines[0]
    return lines[0]


def test_a_training_scripts_import_runs_on_unpatched_with_one_line(damaged, tmp_path):
    """0.4.0: the import died with a traceback (KeyError, JSONDecodeError, FileNotFoundError)."""
    python, what = damaged
    proc = run(python, ["-c", TRAINING_SCRIPT], env_for(megatron=True), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["PATCHED", "False", "False"], proc.stdout
    assert only_line_about_releases(proc.stderr, what).startswith("[gemm_patch] ERROR: gemm_patch not applied: ")


def test_status_exits_1_naming_the_file(damaged, tmp_path):
    python, what = damaged
    proc = run(python, ["-m", "gemm_patch", "status"], env_for(megatron=True), tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gemm-patch status: ") and "releases.json" in last and what in last, proc.stderr
    assert "release data damaged:" in proc.stdout


def test_strict_mode_stops_the_import_naming_the_file(damaged, tmp_path):
    python, what = damaged
    proc = run(python, ["-c", "import gemm_patch"], env_for(GEMM_PATCH_STRICT="1"), tmp_path)
    assert proc.returncode == 1 and "GemmPatchError" in proc.stderr and what in proc.stderr, proc.stderr[-3000:]


@pytest.fixture
def without_startup_module(installed):
    """The module's venv without its start-up module, and without this environment's packages
    (the editable install of the source tree has one too); both put back after the test."""
    python, _ = installed
    site = _site_packages(python)
    startup, dependencies = site / "_gemm_patch_startup.py", site / "a_test_dependencies.pth"
    kept = {path: path.read_bytes() if path.exists() else None for path in (startup, dependencies)}
    startup.unlink()
    dependencies.write_text("")
    yield python
    for path, content in kept.items():
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(content)


def test_auto_without_its_start_up_module_is_one_line_not_a_traceback(without_startup_module, tmp_path):
    """0.4.0: site printed a 12-line traceback ("Error processing line 1 of ...pth") in every
    interpreter of the environment."""
    python = without_startup_module
    proc = run(python, ["-c", "print('ran')"], env_for(GEMM_PATCH_AUTO="1"), tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ran", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("[gemm_patch] ERROR: GEMM_PATCH_AUTO patches nothing here: ") and \
        "_gemm_patch_startup" in lines[0] and "reinstall gemm-patch" in lines[0], lines[0]
    quiet = run(python, ["-c", "print('ran')"], env_for(), tmp_path)  # AUTO unset: the line reads nothing
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
