"""GEMM_PATCH_AUTO: the wheel's .pth start-up hook, in fresh virtual environments with the
package installed from its wheel (built here, offline, from the source tree).

The venvs come from tests/wheel_venvs.py (shared with test_disable.py); megatron-core
comes from PYTHONPATH as in the version matrix, or, where only the import matters, from small
fake packages named like megatron's (``fake_targets``).

The switch is lazy: an interpreter imports gemm_patch (and wrapt) only when it first imports a
module under one of ``_gemm_patch_startup.TRIGGERS`` (megatron, megatron_fsdp).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from process_env import PROBE, ROOT, clean_env, config_error_lines, gemm_patch_command

pytest.register_assert_rewrite("wheel_venvs")  # a plugin (pytest_plugins), imported here first
from wheel_venvs import _site_packages, env_for, run  # noqa: E402

pytest_plugins = ["wheel_venvs"]  # the ``venvs`` fixture (built once per run), shared with test_disable.py

BOOTSTRAP = ROOT / "gemm_patch" / "bootstrap"

PROBE_LOADED = textwrap.dedent("""
    import sys, json
    g = sys.modules.get("gemm_patch")
    print(json.dumps({"loaded": g is not None, "applied": bool(g and g.status().applied),
                      "file": getattr(g, "__file__", None)}))
""")
MODULES = "import sys, json; print(json.dumps(sorted(sys.modules)))"
LOADED = "import sys; print('wrapt' in sys.modules, 'gemm_patch' in sys.modules)"

# Each fake module records, while its own code runs, whether gemm_patch was loaded and applied
# by then, and which loader it was given.
FAKE_MODULE = textwrap.dedent("""
    import sys
    _g = sys.modules.get("gemm_patch")
    LOADED_BEFORE_MY_CODE = _g is not None
    APPLIED_BEFORE_MY_CODE = bool(_g and _g.status().applied)
    MY_LOADER = type(__loader__).__name__
""")


def fake_targets(directory: Path) -> dict[str, Path]:
    """Fake top-level packages with megatron's names and nothing else, one sys.path entry each:
    ``namespace`` (``megatron`` without ``__init__.py``, as megatron-core ships it, with a
    ``megatron.core``), ``regular`` (a ``megatron`` with code) and ``fsdp`` (``megatron_fsdp``)."""
    layout = {"namespace": "megatron/core", "regular": "megatron", "fsdp": "megatron_fsdp"}
    entries = {}
    for kind, package in layout.items():
        entries[kind] = directory / f"fake-{kind}"
        (entries[kind] / package).mkdir(parents=True)
        (entries[kind] / package / "__init__.py").write_text(FAKE_MODULE)
    return entries


FAKE_IMPORT = {"namespace": "megatron.core", "regular": "megatron", "fsdp": "megatron_fsdp"}


def test_wheel_ships_the_pth_at_site_packages_root(venvs):
    site = _site_packages(venvs[0])
    lines = (site / "gemm_patch_auto.pth").read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("import os;")
    assert (site / "_gemm_patch_startup.py").is_file()
    assert (site / "gemm_patch" / "engine" / "releases.json").is_file()  # the targets' release data


def test_auto_1_loads_neither_wrapt_nor_gemm_patch_at_start_up(venvs, tmp_path):
    proc = run(venvs[0], ["-c", LOADED], env_for(GEMM_PATCH_AUTO="1"), tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("kind", ["namespace", "regular", "fsdp"])
def test_auto_1_loads_and_applies_before_the_first_target_package_runs(venvs, tmp_path, kind):
    fakes = fake_targets(tmp_path)
    name = FAKE_IMPORT[kind]
    code = textwrap.dedent(f"""
        import sys, json
        before = "gemm_patch" in sys.modules
        import {name} as m
        import gemm_patch
        finders = [type(f).__name__ for f in sys.meta_path]
        print(json.dumps({{"before": before, "loaded": m.LOADED_BEFORE_MY_CODE,
                          "applied": m.APPLIED_BEFORE_MY_CODE, "loader": m.MY_LOADER,
                          "spec_loader": type(m.__spec__.loader).__name__,
                          "status": gemm_patch.status().applied, "finders": finders}}))
    """)
    proc = run(venvs[0], ["-c", code], env_for(path=(fakes[kind],), GEMM_PATCH_AUTO="1"), tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    state = json.loads(proc.stdout)
    assert not state["before"] and state["loaded"] and state["applied"] and state["status"], state
    # The module's own loader, not the start-up hook's wrapper; the hook's finder is gone.
    assert state["loader"] == state["spec_loader"] == "SourceFileLoader", state
    assert "_Finder" not in state["finders"], state


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
    # Not loaded when the script started (lazy), yet megatron's call site is the patched one:
    # the probe itself never imports gemm_patch.
    assert not report["gemm_patch_loaded_at_start"] and report["call_site"] == "PatchedTwin", report
    assert report["error"] is None and report["rel_error"] < 1e-6 and not report["nan_left"], report

    code = "import megatron.core.tensor_parallel.layers\n" + PROBE_LOADED
    state = json.loads(run(python, ["-c", code], env_for(megatron=True, GEMM_PATCH_AUTO="1"), tmp_path).stdout)
    assert state["applied"] and state["file"].startswith(str(python.parent.parent)), state


@pytest.mark.parametrize("variables", [{}, {"GEMM_PATCH_AUTO": "0"}, {"GEMM_PATCH_AUTO": ""},
                                       {"GEMM_PATCH_AUTO": "1"}, {"GEMM_PATCH_AUTO": "1", "GEMM_PATCH": "0"}])
def test_off_or_no_megatron_imports_nothing_beyond_what_python_imports_anyway(venvs, tmp_path, variables):
    with_wheel, plain = venvs
    got = run(with_wheel, ["-c", MODULES], env_for(**variables), tmp_path)
    baseline = run(plain, ["-c", MODULES], env_for(**variables), tmp_path)
    assert got.returncode == 0 and got.stderr == "", got.stderr
    modules = json.loads(got.stdout)
    if variables.get("GEMM_PATCH_AUTO") == "1":
        # The stdlib-only start-up module: it reads GEMM_PATCH=0 and stops there, or waits
        # for megatron without importing anything.
        modules.remove("_gemm_patch_startup")
    assert modules == json.loads(baseline.stdout)
    assert not [m for m in modules if m.split(".")[0] not in sys.stdlib_module_names | {"__main__"}]


def test_gemm_patch_0_imports_nothing_even_when_megatron_is_imported(venvs, tmp_path):
    fakes = fake_targets(tmp_path)
    code = "import megatron.core, megatron_fsdp\n" + LOADED
    env = env_for(path=(fakes["namespace"], fakes["fsdp"]), GEMM_PATCH_AUTO="1", GEMM_PATCH="0")
    proc = run(venvs[0], ["-c", code], env, tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.split() == ["False", "False"]


def test_gemm_patch_imported_first_is_neither_applied_again_nor_loaded_twice(venvs, tmp_path):
    # The user imports gemm_patch and reverts it; the hook's import on megatron's import must
    # be the no-op that finds it in sys.modules: no second apply, no second module.
    fakes = fake_targets(tmp_path)
    code = textwrap.dedent("""
        import sys, gemm_patch
        gemm_patch.revert()
        first = sys.modules["gemm_patch"]
        import megatron.core
        print(gemm_patch.status().applied, sys.modules["gemm_patch"] is first,
              megatron.core.LOADED_BEFORE_MY_CODE)
    """)
    proc = run(venvs[0], ["-c", code], env_for(path=(fakes["namespace"],), GEMM_PATCH_AUTO="1"), tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.split() == ["False", "True", "True"]


def test_a_missing_target_package_is_a_normal_import_error_and_the_hook_keeps_waiting(venvs, tmp_path):
    fakes = fake_targets(tmp_path)
    code = textwrap.dedent("""
        import sys
        try:
            import megatron_fsdp
        except ImportError as exc:
            print(type(exc).__name__, exc.name)
        print("gemm_patch" in sys.modules)
        import megatron.core
        print(megatron.core.APPLIED_BEFORE_MY_CODE)
    """)
    proc = run(venvs[0], ["-c", code], env_for(path=(fakes["namespace"],), GEMM_PATCH_AUTO="1"), tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.split() == ["ModuleNotFoundError", "megatron_fsdp", "False", "True"]


def test_a_thread_importing_gemm_patch_while_megatron_is_imported_does_not_deadlock(venvs, tmp_path):
    # Thread B is inside gemm_patch's __init__ (a stand-in that waits, then imports a module
    # for the first time: Python's global import lock) when the main thread first imports
    # megatron. Were the hook to import gemm_patch in find_spec (under that global lock) it
    # would wait for B's module lock while B waits for the global one: a deadlock.
    fakes = fake_targets(tmp_path)
    stub = tmp_path / "stub" / "gemm_patch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(textwrap.dedent("""
        import builtins, time, types
        builtins.b_inside.set()
        time.sleep(0.5)
        import colorsys  # noqa: F401  (not imported yet anywhere)
        def status():
            return types.SimpleNamespace(applied=True)
    """))
    code = textwrap.dedent("""
        import builtins, sys, threading
        builtins.b_inside = threading.Event()
        b = threading.Thread(target=__import__, args=("gemm_patch",))
        b.start()
        builtins.b_inside.wait()
        import megatron.core
        b.join()
        print(megatron.core.LOADED_BEFORE_MY_CODE, "colorsys" in sys.modules)
    """)
    env = env_for(path=(tmp_path / "stub", fakes["namespace"]), GEMM_PATCH_AUTO="1")
    proc = subprocess.run([str(venvs[0]), "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.split() == ["True", "True"]


def test_megatron_imported_before_the_hook_starts_is_patched_at_once(tmp_path):
    # A sitecustomize that imports megatron runs before the launcher's hook starts: nothing
    # left to wait for, so the hook imports gemm_patch right away.
    fakes = fake_targets(tmp_path)
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(BOOTSTRAP)!r}, {str(fakes["namespace"])!r}]
        import megatron.core
        import _gemm_patch_startup
        _gemm_patch_startup.start("test")
        g = sys.modules.get("gemm_patch")
        print(g is not None and g.status().applied, type(sys.meta_path[0]).__name__)
    """)
    proc = run(sys.executable, ["-c", code], clean_env(), tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.split()[0] == "True" and proc.stdout.split()[1] != "_Finder", proc.stdout


@pytest.mark.parametrize("variable, value, accepted", [
    ("GEMM_PATCH_AUTO", "maybe", "1, true, yes, on, 0, false, no, off"),
    ("GEMM_PATCH_BACKEND", "cublas", "auto, native, te, fallback"),
    ("GEMM_PATCH", "maybe", "1, true, yes, on, 0, false, no, off"),
])
def test_a_bad_value_is_one_message_and_an_unpatched_running_process(venvs, tmp_path, variable, value,
                                                                        accepted):
    fakes = fake_targets(tmp_path)
    variables = {"GEMM_PATCH_AUTO": "1", variable: value}
    env = env_for(path=(fakes["namespace"],), **variables)
    # Reported when megatron is imported, not before: a process that never imports it says nothing.
    quiet = run(venvs[0], ["-c", LOADED], env, tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout.split() == ["False", "False"]

    proc = run(venvs[0], ["-c", "import megatron.core\n" + PROBE_LOADED], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    state = json.loads(proc.stdout)
    assert state["loaded"] and not state["applied"], state
    lines = config_error_lines(proc.stderr, variable)
    assert len(lines) == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert f"{variable}='{value}' is not accepted" in lines[0] and accepted in lines[0]


def test_a_bad_value_in_strict_mode_stops_the_process_with_one_message(venvs, tmp_path):
    fakes = fake_targets(tmp_path)
    env = env_for(path=(fakes["namespace"],), GEMM_PATCH_AUTO="1", GEMM_PATCH_BACKEND="cublas",
                  GEMM_PATCH_STRICT="1")
    code = "print('before megatron')\nimport megatron.core\nprint('should not run')"
    proc = run(venvs[0], ["-c", code], env, tmp_path)
    assert proc.returncode == 1 and proc.stdout == "before megatron\n"
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "GEMM_PATCH_BACKEND='cublas' is not accepted" in proc.stderr
    assert "[start-up hook: GEMM_PATCH_AUTO, on import of megatron.core]" in proc.stderr


def test_launched_job_that_overwrites_pythonpath_is_still_patched_through_the_pth(venvs, tmp_path):
    # A job script's `export PYTHONPATH=...` drops the launcher's bootstrap directory; the
    # GEMM_PATCH_AUTO=1 that the launcher also set still patches through the installed .pth.
    fakes = fake_targets(tmp_path)
    code = "import megatron.core\n" + PROBE_LOADED
    script = f"PYTHONPATH={fakes['namespace']} exec {venvs[0]} -c '{code}'"
    proc = subprocess.run([*gemm_patch_command(), "run", "--", "sh", "-c", script], env=env_for(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    state = json.loads(proc.stdout)
    assert state["applied"] and state["file"].startswith(str(venvs[0].parent.parent)), state
