"""``GEMM_PATCH=0``: every way of asking for the status says that this variable is why nothing
is applied (the CLI's text and ``--json``, and ``gemm_patch.status()`` in a program)."""

from __future__ import annotations

import json
import subprocess
import sys

from process_env import clean_env, gemm_patch_command

from gemm_patch.targets import REGISTRY


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=clean_env(GEMM_PATCH="0"), timeout=120)


def test_cli_status_names_gemm_patch_0():
    out = run([*gemm_patch_command(), "status", "--all"])
    assert out.returncode == 0, out.stderr
    assert "not applied" in out.stdout.splitlines()[0]
    assert "disabled: GEMM_PATCH=0" in out.stdout
    for target in REGISTRY:
        line = next(line for line in out.stdout.splitlines() if line.split()[:1] == [target.name])
        assert line.split()[1] == "off" and "GEMM_PATCH=0" in line, line


def test_cli_status_json_names_gemm_patch_0():
    out = run([*gemm_patch_command(), "status", "--json"])
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["applied"] is False
    assert data["disabled"] and "GEMM_PATCH=0" in data["disabled"]
    assert {t["name"] for t in data["targets"]} == {t.name for t in REGISTRY}
    for target in data["targets"]:
        assert target["state"] == "off" and target["reason"] == "GEMM_PATCH=0", target


def test_status_in_a_program_names_gemm_patch_0():
    code = ("import gemm_patch, json; s = gemm_patch.status(); print(s)\n"
            "print('STATES', json.dumps({t.name: [t.state, t.reason] for t in s.targets}), s.disabled)")
    out = run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    assert "disabled: GEMM_PATCH=0" in out.stdout
    assert out.stderr == "", "GEMM_PATCH=0 imports silently"
    line = next(line for line in out.stdout.splitlines() if line.startswith("STATES "))
    states = json.loads(line.split(" ", 1)[1].rsplit("}", 1)[0] + "}")
    assert states == {t.name: ["off", "GEMM_PATCH=0"] for t in REGISTRY}
    assert "GEMM_PATCH=0" in line.rsplit("}", 1)[1]
