"""``gemm-patch doctor`` and the stability of ``gemm-patch status --json``."""

from __future__ import annotations

import json
import subprocess

import pytest
from process_env import clean_env, gemm_patch_command

torch = pytest.importorskip("torch")

from gemm_patch.commands import doctor  # noqa: E402
from gemm_patch.gemm.backends import Backend, ExactFallbackBackend  # noqa: E402
from gemm_patch.gemm.dispatcher import WgradDispatcher  # noqa: E402


def cli(*args: str, **variables: str) -> subprocess.CompletedProcess:
    return subprocess.run([*gemm_patch_command(), *args], env=clean_env(**variables),
                          capture_output=True, text=True, timeout=240)


def test_doctor_passes_on_this_device_and_names_the_active_backend():
    proc = cli("doctor", "--no-import")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"device {device}" in proc.stdout
    assert "| case" in proc.stdout and "| active" in proc.stdout
    assert "result: OK" in proc.stdout
    if device == "cpu":
        assert proc.stdout.count("| fallback |") == 4  # every case, active column
        assert "native: unavailable" in proc.stdout


def test_doctor_json_report():
    proc = cli("doctor", "--json", "--no-import")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["schema"] == 1 and report["ok"] is True
    assert len(report["cases"]) == 4
    for case in report["cases"]:
        assert case["ok"] and case["results"][case["active"]].startswith("ok ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="native runs on CUDA")
def test_doctor_fails_when_the_forced_backend_is_missing():
    proc = cli("doctor", "--no-import", GEMM_PATCH_BACKEND="native")
    assert proc.returncode == 1
    assert "GEMM_PATCH_BACKEND=native is missing" in proc.stdout
    assert "result: FAILED" in proc.stdout


def test_doctor_fails_on_a_bad_value_naming_it():
    proc = cli("doctor", "--no-import", GEMM_PATCH_BACKEND="cublas")
    assert proc.returncode == 1
    assert "configuration error: GEMM_PATCH_BACKEND='cublas' is not accepted; use one of auto, native, " \
           "te, fallback" in proc.stdout


class _RoundsTo16Bit(Backend):
    """A backend that is wrong the way a real one can be: the product rounded through bf16."""

    name = "te"

    def supports(self, a, b, out) -> bool:
        return True

    def gemm(self, a, b, out, accumulate) -> None:
        product = (a.float() @ b.float()).to(torch.bfloat16).float()
        out.copy_(out + product if accumulate else product)


def test_doctor_fails_when_the_active_backend_is_wrong():
    dispatcher = WgradDispatcher("auto", backends={"te": _RoundsTo16Bit(), "fallback": ExactFallbackBackend()})
    report = doctor.run_checks("cpu", dispatcher)
    assert not report.ok
    assert all(c.active == "te" and not c.ok and "WRONG" in c.problem for c in report.cases)
    assert all(c.results["fallback"].startswith("ok ") for c in report.cases)
    assert "result: FAILED" in doctor.format_report(report)


def test_doctor_names_the_backend_the_patch_applied(monkeypatch):
    """The setting the report names is the one the dispatcher runs, the patcher's reading of
    the last apply(): a variable changed since is not read again behind its back."""
    import gemm_patch

    monkeypatch.setenv("GEMM_PATCH_BACKEND", "fallback")
    try:
        gemm_patch.apply()
        monkeypatch.setenv("GEMM_PATCH_BACKEND", "native")
        report = doctor.run_checks("cpu")
        assert report.backend_setting == "fallback"
        assert {c.active for c in report.cases} == {"fallback"}, report.cases
    finally:
        monkeypatch.delenv("GEMM_PATCH_BACKEND")
        gemm_patch.revert()
        gemm_patch.apply()


def test_status_json_keeps_its_schema():
    proc = cli("status", "--json", "--no-import")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["schema"] == 1
    stable = {"schema", "gemm_patch", "applied", "strict", "backend", "config_error", "versions",
              "targets", "backends"}
    assert stable <= status.keys()
    assert status["applied"] is True and status["config_error"] is None
    assert {"name", "module", "state", "reason", "version", "fingerprint"} <= status["targets"][0].keys()


def test_status_reports_a_bad_value_once_and_exits_1():
    proc = cli("status", "--json", "--no-import", GEMM_PATCH="maybe")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["config_error"].startswith("GEMM_PATCH='maybe' is not accepted")
    assert proc.stderr.count("GEMM_PATCH='maybe'") == 1


def test_doctor_cuda_without_cuda_ends_in_one_line_and_exits_2():
    # CUDA_VISIBLE_DEVICES="": no device on a CUDA build either (the other branch of the same line)
    proc = cli("doctor", "--device", "cuda", "--no-import", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("gemm-patch doctor: --device cuda: "), proc.stderr
    assert "use --device cpu" in line
    if not torch.backends.cuda.is_built():
        assert f"this torch ({torch.__version__}) is built without CUDA" in line
