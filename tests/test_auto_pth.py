"""GEMM_PATCH_AUTO: the wheel's .pth start-up hook, in fresh virtual environments with the
package installed from its wheel (built here, offline, from the source tree).

Each venv gets this environment's packages (torch, wrapt, ...) through a path-only .pth file
sorted before gemm_patch's, the way they would sit in its own site-packages; megatron-core
comes from PYTHONPATH as in the version matrix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from process_env import PROBE, ROOT, clean_env, config_error_lines, gemm_patch_command

PROBE_LOADED = textwrap.dedent("""
    import sys, json
    g = sys.modules.get("gemm_patch")
    print(json.dumps({"loaded": g is not None, "applied": bool(g and g.status().applied),
                      "file": getattr(g, "__file__", None)}))
""")
MODULES = "import sys, json; print(json.dumps(sorted(sys.modules)))"


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _make_venv(venv: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = _venv_python(venv)
    deps = _site_packages(python) / "a_test_dependencies.pth"
    deps.write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.fixture(scope="module")
def venvs(tmp_path_factory):
    """(python with the gemm-patch wheel installed, python of an identical venv without it)."""
    tmp = tmp_path_factory.mktemp("auto")
    try:
        import hatchling  # noqa: F401  (the build backend: build offline, without isolation)
        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                    "-w", str(tmp / "dist"), str(ROOT)], check=True, capture_output=True)
    wheel = next((tmp / "dist").glob("gemm_patch-*.whl"))
    with_wheel = _make_venv(tmp / "with-wheel")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(with_wheel), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True)
    return with_wheel, _make_venv(tmp / "plain")


def env_for(megatron: bool = False, **variables: str) -> dict[str, str]:
    env = clean_env(megatron=megatron, **variables)
    # Not the source tree: gemm_patch must come from the installed wheel.
    env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep)
                                        if p and Path(p) != ROOT)
    return env


def run(python, args, env, cwd):
    return subprocess.run([str(python), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=240)


def test_wheel_ships_the_pth_at_site_packages_root(venvs):
    site = _site_packages(venvs[0])
    lines = (site / "gemm_patch_auto.pth").read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("import os;")
    assert (site / "_gemm_patch_startup.py").is_file()


def test_auto_1_patches_a_bare_megatron_import(venvs, tmp_path):
    python = venvs[0]
    bare = run(python, ["-c", "import megatron.core.tensor_parallel.layers"],
               env_for(megatron=True, GEMM_PATCH_AUTO="1"), tmp_path)
    assert bare.returncode == 0, bare.stderr
    assert "[gemm_patch] INFO: megatron-core 0.17.1: fsdp-wgrad" in bare.stderr, bare.stderr

    out = tmp_path / "probe.json"
    proc = run(python, [str(PROBE), str(out)], env_for(megatron=True, GEMM_PATCH_AUTO="1"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["gemm_patch_loaded_at_start"] and report["call_site"] == "PatchedCallSite", report
    assert report["error"] is None and report["rel_error"] < 1e-6 and not report["nan_left"], report

    state = json.loads(run(python, ["-c", PROBE_LOADED], env_for(GEMM_PATCH_AUTO="1"), tmp_path).stdout)
    assert state["applied"] and state["file"].startswith(str(python.parent.parent)), state


@pytest.mark.parametrize("variables", [{}, {"GEMM_PATCH_AUTO": "0"}, {"GEMM_PATCH_AUTO": ""},
                                       {"GEMM_PATCH_AUTO": "1", "GEMM_PATCH": "0"}])
def test_off_imports_nothing_beyond_what_python_imports_anyway(venvs, tmp_path, variables):
    with_wheel, plain = venvs
    got = run(with_wheel, ["-c", MODULES], env_for(**variables), tmp_path)
    baseline = run(plain, ["-c", MODULES], env_for(**variables), tmp_path)
    assert got.returncode == 0 and got.stderr == "", got.stderr
    modules = json.loads(got.stdout)
    if variables.get("GEMM_PATCH_AUTO") == "1":
        # GEMM_PATCH=0 is read by the stdlib-only start-up module, which stops there.
        modules.remove("_gemm_patch_startup")
    assert modules == json.loads(baseline.stdout)
    assert not [m for m in modules if m.split(".")[0] not in sys.stdlib_module_names | {"__main__"}]


@pytest.mark.parametrize("variable, value, accepted", [
    ("GEMM_PATCH_AUTO", "maybe", "1, true, yes, on, 0, false, no, off"),
    ("GEMM_PATCH_BACKEND", "cublas", "auto, te, native, fallback"),
    ("GEMM_PATCH", "maybe", "1, true, yes, on, 0, false, no, off"),
])
def test_a_bad_value_is_one_message_and_an_unpatched_running_process(venvs, tmp_path, variable, value,
                                                                        accepted):
    variables = {"GEMM_PATCH_AUTO": "1", variable: value}
    proc = run(venvs[0], ["-c", PROBE_LOADED], env_for(**variables), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["applied"] is False
    lines = config_error_lines(proc.stderr, variable)
    assert len(lines) == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert f"{variable}='{value}' is not accepted" in lines[0] and accepted in lines[0]


def test_a_bad_value_in_strict_mode_stops_the_process_with_one_message(venvs, tmp_path):
    env = env_for(GEMM_PATCH_AUTO="1", GEMM_PATCH_BACKEND="cublas", GEMM_PATCH_STRICT="1")
    proc = run(venvs[0], ["-c", "print('should not run')"], env, tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "GEMM_PATCH_BACKEND='cublas' is not accepted" in proc.stderr
    assert "[start-up hook: GEMM_PATCH_AUTO]" in proc.stderr


def test_launched_job_that_overwrites_pythonpath_is_still_patched_through_the_pth(venvs, tmp_path):
    # A job script's `export PYTHONPATH=...` drops the launcher's bootstrap directory; the
    # GEMM_PATCH_AUTO=1 that the launcher also set still patches through the installed .pth.
    script = f"PYTHONPATH={tmp_path} exec {venvs[0]} -c '{PROBE_LOADED}'"
    proc = subprocess.run([*gemm_patch_command(), "run", "--", "sh", "-c", script], env=env_for(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    state = json.loads(proc.stdout)
    assert state["applied"] and state["file"].startswith(str(venvs[0].parent.parent)), state
