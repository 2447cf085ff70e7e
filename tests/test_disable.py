"""GEMM_PATCH_DISABLE through the three entry points (``import gemm_patch``, ``gemm-patch run``,
``GEMM_PATCH_AUTO=1`` with the installed wheel's .pth), with a real megatron-core release: the listed
targets read ``off`` (naming the variable) and megatron's objects stay the originals, the others
are patched; an unknown name is one ERROR line and nothing patched; ``gemm-patch status``
exits 1 naming the variable."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from process_env import clean_env, gemm_patch_command

pytest.register_assert_rewrite("wheel_venvs")  # a plugin (pytest_plugins), imported here first
from wheel_venvs import env_for, run  # noqa: E402

pytest_plugins = ["wheel_venvs"]  # ``venvs``: the wheel installed in a fresh venv, built once per test run

REPORT = """
import json, megatron.core.tensor_parallel.layers as L, gemm_patch
backward = vars(L.LinearWithGradAccumulationAndAsyncCommunication)["backward"]
print("REPORT", json.dumps({
    "states": {t.name: [t.state, t.reason] for t in gemm_patch.status().targets},
    "backward_is_gemm_patch": getattr(backward, "_self_gemm_patch_target", None) is not None,
    "stand_in": getattr(vars(L).get("fused_weight_gradient_mlp_cuda"), "__gemm_patch_stand_in__", False),
}))
"""
# What status says right after `import gemm_patch`, before megatron is imported.
IMPORT_FIRST = ("import gemm_patch, json\n"
                "print('BEFORE', json.dumps({t.name: t.state for t in gemm_patch.status().targets}))\n" + REPORT)


def report(out: subprocess.CompletedProcess) -> dict:
    line = next((line for line in out.stdout.splitlines() if line.startswith("REPORT ")), None)
    assert out.returncode == 0 and line, out.stderr[-3000:]
    return json.loads(line[len("REPORT "):])


def assert_left_out(found: dict) -> None:
    states = found["states"]
    for name in ("fsdp-wgrad", "apex-wgrad"):
        assert states[name][0] == "off" and "GEMM_PATCH_DISABLE" in states[name][1], states[name]
    assert not found["backward_is_gemm_patch"] and not found["stand_in"], "megatron's objects are the originals"
    assert states["fsdp-te-overwrite"][0] == "pending" or states["fsdp-te-overwrite"][0] == "verified"


def test_import_gemm_patch():
    env = clean_env(megatron=True, GEMM_PATCH_DISABLE="fsdp-wgrad,apex-wgrad")
    out = subprocess.run([sys.executable, "-c", IMPORT_FIRST + "import megatron.core.distributed\n" + REPORT],
                         capture_output=True, text=True, env=env, timeout=300)
    found = report(out)
    assert_left_out(found)
    assert found["states"]["fsdp-te-overwrite"][0] == "verified"
    before = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("BEFORE "))[7:])
    assert before["fsdp-wgrad"] == before["apex-wgrad"] == "off", "a target turned off never reads pending"
    assert before["fsdp-te-overwrite"] == "pending"


def test_gemm_patch_run():
    env = clean_env(megatron=True, GEMM_PATCH_DISABLE="fsdp-wgrad,apex-wgrad")
    out = subprocess.run([*gemm_patch_command(), "run", "--", "python", "-c", REPORT],
                         capture_output=True, text=True, env=env, timeout=300)
    assert_left_out(report(out))


def test_auto_pth(venvs, tmp_path):
    """The wheel's start-up hook applies on megatron's first import; the listed targets stay off."""
    env = env_for(megatron=True, GEMM_PATCH_AUTO="1", GEMM_PATCH_DISABLE="fsdp-wgrad,apex-wgrad")
    code = REPORT + "print('FILE', gemm_patch.__file__, gemm_patch.status().applied)\n"
    out = run(venvs[0], ["-c", code], env, tmp_path)
    found = report(out)
    assert_left_out(found)
    _, file, applied = next(line for line in out.stdout.splitlines() if line.startswith("FILE ")).split()
    assert applied == "True" and file.startswith(str(venvs[0].parent.parent)), "applied by the wheel's hook"


def test_unknown_name_is_one_error_and_nothing_patched():
    env = clean_env(megatron=True, GEMM_PATCH_DISABLE="fsdp-wgrad,bogus")
    out = subprocess.run([sys.executable, "-c", IMPORT_FIRST], capture_output=True, text=True, env=env, timeout=300)
    found = report(out)
    errors = [line for line in out.stderr.splitlines() if line.startswith("[gemm_patch] ERROR:")]
    assert len(errors) == 1 and "'bogus'" in errors[0] and "fsdp-wgrad" in errors[0] and "apex-wgrad" in errors[0], \
        out.stderr
    assert not found["backward_is_gemm_patch"] and not found["stand_in"]
    assert not [s for s, _ in found["states"].values() if s in ("verified", "compatible", "forced")]


def test_status_with_an_unknown_name_exits_1():
    env = clean_env(GEMM_PATCH_DISABLE="fsdp-wgrad,bogus")
    out = subprocess.run([*gemm_patch_command(), "status"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1, out
    assert "gemm-patch status: GEMM_PATCH_DISABLE=" in out.stderr, out.stderr
    assert (out.stdout + out.stderr).count("names no target 'bogus'") == 1, "the error is said once"
    assert "configuration error: GEMM_PATCH_DISABLE holds a value" in out.stdout
