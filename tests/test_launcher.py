"""``gemm-patch run``: real processes only. The children never import gemm_patch themselves;
tests/probes/fsdp_probe.py reports whether a start-up hook loaded it and runs megatron-core's
FSDP wgrad path with an fp32 main_grad against fp64.

The hook is lazy: a child imports gemm_patch when it first imports megatron (or
megatron_fsdp), so the probe starts without it and still runs the patched call site; the
other children import a fake ``megatron.core`` (tests/test_auto_pth.py's ``fake_targets``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from process_env import PROBE, clean_env, config_error_lines, free_port, gemm_patch_command
from test_auto_pth import LOADED, fake_targets

RUN = [*gemm_patch_command(), "run", "--"]

# Imports (fake) megatron, then prints whether a start-up hook loaded gemm_patch and whether it
# is applied, without importing it when it is not loaded.
STATE = ("import sys, json, megatron.core; g = sys.modules.get('gemm_patch'); "
         "print(json.dumps({'loaded': g is not None, 'applied': bool(g and g.status().applied)}))")


def run(cmd, env, **kwargs):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, **kwargs)


def state_of(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def with_fake_megatron(env: dict[str, str], tmp_path) -> dict[str, str]:
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(fake_targets(tmp_path)["namespace"]), env["PYTHONPATH"]]))
    return env


def assert_patched_and_exact(report: dict) -> None:
    # Loaded on megatron's import, not at start-up; the probe never imports gemm_patch itself.
    assert not report["gemm_patch_loaded_at_start"], report
    assert report["call_site"] == "PatchedTwin", report
    assert report["error"] is None, report
    assert not report["nan_left"] and report["rel_error"] < 1e-6, report


def test_child_is_patched(tmp_path):
    out = tmp_path / "probe.json"
    proc = run([*RUN, "python", str(PROBE), str(out)], clean_env(megatron=True))
    assert proc.returncode == 0, proc.stderr
    assert_patched_and_exact(json.loads(out.read_text()))


def test_gemm_patch_0_leaves_the_child_alone(tmp_path):
    out = tmp_path / "probe.json"
    proc = run([*RUN, "python", str(PROBE), str(out)], clean_env(megatron=True, GEMM_PATCH="0"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert not report["gemm_patch_loaded_at_start"]
    assert report["call_site"] == "staticmethod"
    assert "Expected out tensor to have dtype" in report["error"]  # megatron's own crash
    assert "gemm_patch" not in proc.stderr


def test_existing_sitecustomize_still_runs_first(tmp_path):
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    marker = tmp_path / "marker.txt"
    (user_dir / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import sys
        FROM_USER = True
        with open({str(marker)!r}, "w") as f:
            f.write("ran; gemm_patch loaded before me: %s" % ("gemm_patch" in sys.modules))
    """))
    env = with_fake_megatron(clean_env(), tmp_path)
    env["PYTHONPATH"] = f"{user_dir}:{env['PYTHONPATH']}"
    code = "import sitecustomize; print(sitecustomize.FROM_USER, sitecustomize.__file__); " + STATE
    proc = run([*RUN, "python", "-c", code], env)
    assert state_of(proc) == {"loaded": True, "applied": True}
    assert marker.read_text() == "ran; gemm_patch loaded before me: False"
    assert proc.stdout.split()[:2] == ["True", str(user_dir / "sitecustomize.py")]
    assert proc.stderr == ""


def test_a_failing_sitecustomize_is_reported_as_python_would_and_the_patch_still_applies(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("raise ValueError('broken by its owner')\n")
    env = with_fake_megatron(clean_env(), tmp_path)
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    without = run([sys.executable, "-c", "pass"], env)
    proc = run([*RUN, "python", "-c", STATE], env)
    assert state_of(proc) == {"loaded": True, "applied": True}
    # "Error in sitecustomize; ... ValueError: broken by its owner", as without the launcher,
    # from both interpreters: the gemm-patch command's own and the child's.
    assert "broken by its owner" in without.stderr
    assert proc.stderr == without.stderr * 2


def test_multiprocessing_spawn_workers_are_patched(tmp_path):
    proc = run([*RUN, "python", str(PROBE), "--spawn", str(tmp_path)], clean_env(megatron=True))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "spawn.json").read_text())
    assert len({w["pid"] for w in result["workers"]} | {result["parent_pid"]}) == 3
    for worker in result["workers"]:
        assert_patched_and_exact(worker)


def test_torchrun_gloo_workers_are_patched_and_match_fp64(tmp_path):
    cmd = [*RUN, "python", "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(PROBE), "--dist", str(tmp_path)]
    proc = run(cmd, clean_env(megatron=True))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1]
    assert reports[0]["pid"] != reports[1]["pid"]
    for report in reports:
        assert report["world_size"] == 2 and report["backend"] == "gloo"
        assert_patched_and_exact(report)
        assert report["allreduce_rel_error"] < 1e-6, report


@pytest.mark.parametrize("variable, value, accepted", [
    ("GEMM_PATCH_BACKEND", "cublas", "auto, native, te, fallback"),
    ("GEMM_PATCH", "maybe", "1, true, yes, on, 0, false, no, off"),
])
def test_a_bad_value_is_one_message_and_an_unpatched_running_child(variable, value, accepted, tmp_path):
    env = with_fake_megatron(clean_env(**{variable: value}), tmp_path)
    proc = run([*RUN, "python", "-c", STATE + "; print('still running')"], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-2:] == ["still", "running"]
    assert json.loads(proc.stdout.splitlines()[0]) == {"loaded": True, "applied": False}
    lines = config_error_lines(proc.stderr, variable)
    assert len(lines) == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert f"{variable}='{value}' is not accepted" in lines[0] and accepted in lines[0]


def test_a_bad_value_in_strict_mode_stops_the_child_with_one_message(tmp_path):
    env = with_fake_megatron(clean_env(GEMM_PATCH_BACKEND="cublas", GEMM_PATCH_STRICT="1"), tmp_path)
    proc = run([*RUN, "python", "-c", "import megatron.core; print('should not run')"], env)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "GEMM_PATCH_BACKEND='cublas' is not accepted" in proc.stderr
    assert "[start-up hook: gemm-patch run, on import of megatron.core]" in proc.stderr
    assert "GEMM_PATCH_STRICT=1" in proc.stderr


def test_a_child_that_never_imports_megatron_loads_neither_wrapt_nor_gemm_patch():
    proc = run([*RUN, "python", "-c", LOADED], clean_env())
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.split() == ["False", "False"]


def test_a_sitecustomize_that_imports_megatron_runs_first_and_the_child_is_patched(tmp_path):
    # Nothing of gemm_patch's while the user's sitecustomize runs, even though it imports
    # megatron; the hook then finds megatron imported and loads gemm_patch at once.
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    (user_dir / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys
        import megatron.core
        GEMM_PATCH_LOADED = "gemm_patch" in sys.modules
    """))
    env = with_fake_megatron(clean_env(), tmp_path)
    env["PYTHONPATH"] = f"{user_dir}:{env['PYTHONPATH']}"
    proc = run([*RUN, "python", "-c", "import sitecustomize; print(sitecustomize.GEMM_PATCH_LOADED); " + STATE],
               env)
    assert state_of(proc) == {"loaded": True, "applied": True}
    assert proc.stdout.split()[0] == "False"
    assert proc.stderr == ""


def _python_without_gemm_patch(cwd) -> str:
    """The interpreter this venv was made from: a Python that cannot import gemm_patch, as a
    job script might start one."""
    base = getattr(sys, "_base_executable", None) or ""
    env = clean_env()
    env["PYTHONPATH"] = ""
    if not base or base == sys.executable or run([base, "-c", "import gemm_patch"], env, cwd=cwd).returncode == 0:
        pytest.skip("no interpreter here that lacks gemm_patch")
    return base


@pytest.mark.parametrize("strict", ["0", "1"])
def test_an_interpreter_without_gemm_patch_gets_one_line(strict, tmp_path):
    python = _python_without_gemm_patch(tmp_path)
    env = clean_env(GEMM_PATCH_STRICT=strict)
    env["PYTHONPATH"] = str(fake_targets(tmp_path)["namespace"])
    proc = run([*RUN, python, "-c", "import megatron.core; print('alive')"], env, cwd=tmp_path)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "cannot import gemm_patch" in lines[0], proc.stderr
    if strict == "1":
        assert proc.returncode == 1 and proc.stdout == ""
    else:
        assert proc.returncode == 0 and proc.stdout.strip() == "alive"
        assert lines[0].endswith("this process runs unpatched")


def test_nested_launchers_put_the_bootstrap_on_the_path_once():
    code = "import os; print(os.environ['PYTHONPATH'])"
    proc = run([*RUN, *RUN, "python", "-c", code], clean_env())
    assert proc.returncode == 0, proc.stderr
    entries = proc.stdout.strip().split(":")
    assert entries[0].endswith("bootstrap") and sum(e.endswith("bootstrap") for e in entries) == 1


def test_a_missing_command_exits_127():
    proc = run([*RUN, "gemm-patch-no-such-command"], clean_env())
    assert proc.returncode == 127
    assert "command not found" in proc.stderr
