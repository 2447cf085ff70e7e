"""Strict mode under a start-up hook (``gemm-patch run``, ``GEMM_PATCH_AUTO=1``): gemm_patch
refusing code it does not know while megatron is imported is one line on stderr and exit
status 1, whether the import happens in the main thread or in another one. Real processes,
a real megatron-core release with its FSDP wgrad call site edited (unknown code)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from process_env import clean_env, gemm_patch_command

CALL = "torch.matmul(grad_output.t(), total_input, out=weight.main_grad)"
RUN = [*gemm_patch_command(), "run", "--"]

IMPORT = "import megatron.core.tensor_parallel.layers\nprint('still running')\n"
IN_A_THREAD = ("import threading, time\n"
               "t = threading.Thread(target=lambda: __import__('megatron.core.tensor_parallel.layers'))\n"
               "t.start(); t.join(); time.sleep(0.5)\n"
               "print('still running')\n")


@pytest.fixture(scope="module")
def edited_env(tmp_path_factory) -> dict[str, str]:
    """clean_env(megatron=True) with the release's layers.py edited around the call site."""
    env = clean_env(megatron=True)
    source = next(Path(p) / "megatron" for p in env["PYTHONPATH"].split(os.pathsep)
                  if (Path(p) / "megatron" / "core" / "tensor_parallel" / "layers.py").is_file())
    root = tmp_path_factory.mktemp("edited")
    shutil.copytree(source, root / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    layers = root / "megatron" / "core" / "tensor_parallel" / "layers.py"
    text = layers.read_text()
    if CALL not in text:
        pytest.skip("this release has no FSDP wgrad call site to edit")
    pad = text[:text.index(CALL)].rsplit("\n", 1)[1]
    layers.write_text(text.replace(CALL, f"_earlier = weight.main_grad.clone()\n{pad}{CALL}\n"
                                         f"{pad}weight.main_grad.add_(_earlier)", 1))
    env["PYTHONPATH"] = os.pathsep.join([str(root), env["PYTHONPATH"]])
    return env


def run(cmd, env):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("where", ["main thread", "other thread"])
@pytest.mark.parametrize("entry", ["gemm-patch run", "GEMM_PATCH_AUTO=1"])
def test_strict_refusal_of_unknown_code_is_one_line_and_exit_1(edited_env, entry, where):
    env = {**edited_env, "GEMM_PATCH_STRICT": "1"}
    code = IMPORT if where == "main thread" else IN_A_THREAD
    if entry == "gemm-patch run":
        cmd = [*RUN, "python", "-c", code]
    else:
        # What the .pth line runs at start-up, done by hand: the source tree has no .pth.
        env["GEMM_PATCH_AUTO"] = "1"
        hook = Path(__file__).resolve().parent.parent / "gemm_patch" / "bootstrap"
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(hook)])
        cmd = ["python", "-c", "import _gemm_patch_startup; _gemm_patch_startup.start('GEMM_PATCH_AUTO')\n" + code]
    proc = run(cmd, env)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("[gemm_patch] ERROR: "), lines[0]
    assert "unverified" in lines[0] or "unknown" in lines[0], lines[0]
    assert "GEMM_PATCH_STRICT=1" in lines[0] and "on import of megatron.core.tensor_parallel.layers" in lines[0]


def test_strict_refusal_of_a_bad_value_is_one_line_and_exit_1_from_a_thread(edited_env):
    env = {**edited_env, "GEMM_PATCH_STRICT": "1", "GEMM_PATCH_BACKEND": "bogus"}
    proc = run([*RUN, "python", "-c", IN_A_THREAD], env)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[gemm_patch] ERROR: "), proc.stderr
    assert "GEMM_PATCH_BACKEND='bogus' is not accepted" in lines[0]


def test_without_strict_unknown_code_is_one_warning_and_the_process_runs(edited_env):
    proc = run([*RUN, "python", "-c", IN_A_THREAD], edited_env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "still running"
    assert "[gemm_patch] WARNING:" in proc.stderr and "Traceback" not in proc.stderr
