"""The ``gemm-patch`` command as a newcomer meets it: real processes of the real console script.

Every way it can stop ends in one readable line and an exit status that ``--help`` documents
(0 ok; 1 strict refusal, bad value, failed check; 2 usage error or nothing to do here), never in
a traceback; the help is plain text; megatron's own import warnings are counted, not shown.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from process_env import ISOLATE, ROOT, clean_env, gemm_patch_command, without_installed_megatron

sys.path.insert(0, str(ROOT / "compat"))
import matrix  # noqa: E402

# Releases without Megatron-FSDP's fused wgrad call: 0.13.1 is in the support table (the apex
# path only); 0.12.3, the last 0.12, is older than the table.
RELEASES_WITHOUT_FSDP_CALL = ("0.13.1", "0.12.3")
# A verified release with the call (and megatron's import warnings), installable on Python 3.10+.
RELEASE = "0.16.1"
FSDP_CALL = "                    torch.matmul(grad_output.t(), total_input, out=weight.main_grad)\n"
WARNINGS_NOTE = re.compile(r"\((\d+) warnings? from importing megatron suppressed; "
                           r"GEMM_PATCH_LOG_LEVEL=DEBUG shows them\)")


def install(version: str) -> Path:
    """A megatron-core release in its own folder, where and as compat/ installs the matrix's
    (compat/matrix.py ``ensure_release``: pip --no-deps --target compat/.cache/mcore-X under a
    lock, so a matrix running beside these tests never installs the same folder at the same
    time). Only releases that pip installs for any Python gemm-patch supports (>= 3.10)."""
    return matrix.ensure_release(matrix.Release("megatron-core", version, "mcore", "tests/megatron"))


def env_for(*path: Path | str, **variables: str) -> dict[str, str]:
    """megatron from ``path`` only (ISOLATE hides any of the interpreter's site-packages)."""
    env = clean_env(**variables)
    env["PYTHONPATH"] = os.pathsep.join([str(ISOLATE), *map(str, path), str(ROOT)])
    return env


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*gemm_patch_command(), *args], env=env or clean_env(), capture_output=True,
                          text=True, timeout=300)


@functools.cache
def on_release(command: str) -> subprocess.CompletedProcess:
    """``gemm-patch <command>`` on RELEASE as a user's shell runs it (no PYTHONWARNINGS: Python's
    own warning filters), once per test run: tests/test_readme_samples.py compares the same
    output with the README."""
    return cli(command, env=user_env())


def user_env() -> dict[str, str]:
    env = env_for(install(RELEASE))
    del env["PYTHONWARNINGS"]
    return env


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def assert_one_line_end(proc: subprocess.CompletedProcess, prefix: str) -> str:
    """The command ended in one line on stderr that starts with ``prefix``, and nowhere a traceback."""
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output
    line = last_line(proc.stderr)
    assert line.startswith(prefix), output
    return line


@pytest.fixture(scope="module")
def unverified_release(tmp_path_factory) -> Path:
    """A verified release with its FSDP branch edited the way an upstream fix of the overwrite bug
    could look (the buffer's earlier content added back around the same call): code no release
    of the support table has, so fsdp-wgrad reads unverified."""
    root = tmp_path_factory.mktemp("mcore-unverified")
    shutil.copytree(install(RELEASE), root, dirs_exist_ok=True)
    layers = root / "megatron" / "core" / "tensor_parallel" / "layers.py"
    source = layers.read_text()
    assert source.count(FSDP_CALL) == 1
    indent = " " * 20
    layers.write_text(source.replace(FSDP_CALL, f"{indent}previous = weight.main_grad.clone()\n{FSDP_CALL}"
                                                f"{indent}weight.main_grad += previous\n"))
    return root


# --- 1. demo on a release without the Megatron-FSDP fused call --------------------------------


@pytest.mark.parametrize("version", RELEASES_WITHOUT_FSDP_CALL)
def test_demo_on_a_release_without_the_fsdp_call_says_so_and_exits_2(version):
    proc = cli("demo", env=env_for(install(version)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = assert_one_line_end(proc, f"gemm-patch demo: nothing to show on megatron-core {version}: "
                                     f"it has no Megatron-FSDP fused wgrad call")
    assert "NameError" not in proc.stdout + proc.stderr
    assert "fsdp-wgrad not applicable" in line
    assert proc.stdout == ""


def test_demo_shows_the_crash_then_the_fix():
    proc = on_release("demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"megatron-core {RELEASE}" in proc.stdout
    assert "unpatched, fp32 main_grad: RuntimeError" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| fp32 (gemm_patch)"))
    assert float(row.split("|")[3]) < 1e-5 and row.split("|")[4].strip() == "no"


def test_demo_with_the_patch_off_exits_2_in_one_line():
    proc = cli("demo", env=env_for(install(RELEASE), GEMM_PATCH="0"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_one_line_end(proc, "gemm-patch demo: fsdp-wgrad is off (GEMM_PATCH=0 turns gemm_patch off)")
    assert proc.stdout == ""


def test_demo_on_unknown_code_exits_1_in_one_line(unverified_release):
    proc = cli("demo", env=env_for(unverified_release))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert_one_line_end(proc, "gemm-patch demo: fsdp-wgrad is unverified, not patched: ")
    assert proc.stdout == ""


def test_demo_without_megatron_exits_2_in_one_line():
    """Also where the venv has megatron-core (as the README's demo installs it): hidden."""
    proc = cli("demo", env=without_installed_megatron(clean_env()))
    assert proc.returncode == 2
    assert_one_line_end(proc, "gemm-patch demo: needs torch and megatron-core importable")


# --- 3. strict mode on an unverified release --------------------------------------------------


def test_the_edited_release_reads_unverified(unverified_release):
    proc = cli("status", env=env_for(unverified_release))  # PYTHONWARNINGS=ignore: nothing to count
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^  fsdp-wgrad +unverified ", proc.stdout, re.M), proc.stdout
    assert "suppressed" not in proc.stdout


@pytest.mark.parametrize("command", [("status",), ("status", "--json"), ("doctor",), ("doctor", "--json"),
                                     ("demo",)])
def test_strict_refusal_ends_in_one_line_and_exit_1(unverified_release, command):
    proc = cli(*command, env=env_for(unverified_release, GEMM_PATCH_STRICT="1"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = assert_one_line_end(proc, f"gemm-patch {command[0]}: fsdp-wgrad: ")
    assert "GEMM_PATCH_STRICT=1" in line
    assert proc.stdout == ""


def test_strict_refusal_of_a_bad_value_ends_in_one_line_and_exit_1():
    proc = cli("status", env=clean_env(GEMM_PATCH_STRICT="1", GEMM_PATCH_BACKEND="cublas"))
    assert proc.returncode == 1
    line = assert_one_line_end(proc, "gemm-patch status: GEMM_PATCH_BACKEND='cublas' is not accepted")
    assert "GEMM_PATCH_STRICT=1" in line


# --- 4, 5, 7. --version, plain-text help, documented exit statuses ----------------------------


def test_version():
    version = re.search(r'^__version__ = "([^"]+)"', (ROOT / "gemm_patch" / "__init__.py").read_text(), re.M)[1]
    proc = cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"gemm-patch {version}\n"


@pytest.mark.parametrize("command", [(), ("status",), ("demo",), ("doctor",), ("run",)])
def test_help_is_plain_text(command):
    proc = cli(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    for markup in ("``", ":func:", ":class:", ".. "):
        assert markup not in proc.stdout, proc.stdout


def test_help_documents_every_exit_status():
    text = cli("--help").stdout
    epilog = text[text.index("exit status:"):]
    for status in ("0", "1", "2"):
        assert re.search(rf"^  {status}  \S", epilog, re.M), epilog
    assert "GEMM_PATCH_STRICT=1" in epilog and "--device cuda" in epilog and "demo" in epilog
    assert "run: the exit status of COMMAND" in epilog


def test_a_usage_error_exits_2():
    assert cli("no-such-command").returncode == 2
    assert cli().returncode == 2


# --- 6. megatron's import warnings are counted, not shown -------------------------------------


def test_status_counts_megatron_warnings_instead_of_showing_them():
    env = user_env()
    proc = on_release("status")
    assert proc.returncode == 0, proc.stderr
    assert "Warning:" not in proc.stderr and "warnings.warn" not in proc.stderr, proc.stderr
    notes = [m for line in proc.stdout.splitlines() if (m := WARNINGS_NOTE.search(line))]
    assert len(notes) == 1, proc.stdout
    count = int(notes[0][1])
    assert count >= 1
    assert last_line(proc.stdout).strip() == notes[0][0]

    debug = cli("status", env={**env, "GEMM_PATCH_LOG_LEVEL": "DEBUG"})
    shown = [line for line in debug.stderr.splitlines()
             if line.startswith("[gemm_patch] DEBUG: warning while importing the target modules:")]
    assert len(shown) == count, debug.stderr
    assert not WARNINGS_NOTE.search(debug.stdout), "under DEBUG they are shown, not suppressed"

    as_json = cli("status", "--json", env=env)
    json.loads(as_json.stdout)  # stdout stays pure JSON: the count goes to stderr
    assert WARNINGS_NOTE.search(as_json.stderr) and "Warning:" not in as_json.stderr



def test_doctor_counts_megatron_warnings_instead_of_showing_them():
    proc = cli("doctor", "--device", "cpu", env=env_for(install(RELEASE), PYTHONWARNINGS="default"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning:" not in proc.stderr and "warnings.warn" not in proc.stderr, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith(f"patch: applied; megatron-core {RELEASE}: fsdp-wgrad verified"), proc.stdout
    assert WARNINGS_NOTE.fullmatch(lines[2].strip()), proc.stdout
