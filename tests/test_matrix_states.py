"""The states of the version matrix's release line, read in the release's own pytest process before
pytest loads a conftest or a test (compat/matrix_states.py): what a fresh import gives, on a real
release, and a failure said instead of states."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from process_env import MEGATRON_RELEASE, ROOT, matrix

COMPAT = ROOT / "compat"
sys.path.insert(0, str(COMPAT))
import matrix_states  # noqa: E402

# The conftest records what was imported before pytest loaded it; the test, that the plugin's
# imports left gemm_patch applied as usual.
CONFTEST = '''
import json, os, sys
SEEN = {"gemm_patch": "gemm_patch" in sys.modules, "layers": "megatron.core.tensor_parallel.layers" in sys.modules}
open(os.environ["SEEN"], "w").write(json.dumps(SEEN))
'''
TEST = '''
import gemm_patch
def test_applied():
    assert gemm_patch.status().targets
'''


def run_pytest(tmp_path: Path, env: dict[str, str], names: str) -> tuple[subprocess.CompletedProcess, dict]:
    folder = tmp_path / "suite"
    folder.mkdir()
    (folder / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (folder / "test_applied.py").write_text(textwrap.dedent(TEST))
    states = tmp_path / "states.json"
    env = {**env, "PYTHONPATH": f"{env['PYTHONPATH']}:{COMPAT}", "SEEN": str(tmp_path / "seen.json"),
           matrix_states.STATES_ENV: str(states), matrix_states.NAMES_ENV: names}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "matrix_states",
                           str(folder)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    return proc, json.loads(states.read_text())


def test_a_release_states_are_read_before_the_first_conftest(tmp_path):
    env = matrix.release_env(MEGATRON_RELEASE)
    expected = json.loads(env["GEMM_PATCH_MATRIX_EXPECT"])
    proc, found = run_pytest(tmp_path, env, f"megatron-core:{','.join(expected)}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert found["version"].startswith(MEGATRON_RELEASE) and found["states"] == expected
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {"gemm_patch": True, "layers": True}  # read before the conftest, as a fresh process imports
    # and the same in a process of its own (compat/matrix.py's fallback)
    alone = subprocess.run([sys.executable, "-c", matrix_states.PROBE, "megatron-core", ",".join(expected)],
                           env={**env, "PYTHONPATH": f"{env['PYTHONPATH']}:{COMPAT}"}, capture_output=True, text=True,
                           timeout=300)
    assert json.loads(alone.stdout.strip().splitlines()[-1]) == found


def test_a_failure_to_read_them_is_said_and_the_tests_still_run(tmp_path):
    broken = tmp_path / "broken"
    (broken / "gemm_patch").mkdir(parents=True)
    (broken / "gemm_patch" / "__init__.py").write_text("raise RuntimeError('a damaged gemm_patch')\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(broken)}
    proc, found = run_pytest(tmp_path, env, "megatron-core:fsdp-wgrad")
    assert found == {"error": "RuntimeError: a damaged gemm_patch"}
    # the suite itself still runs, meets the same damaged package and says so
    assert proc.returncode != 0 and "RuntimeError: a damaged gemm_patch" in proc.stdout
