"""The version matrix: install each megatron-core release of compat/matrix.json side by side,
run tests/megatron against it in its own interpreter, and write compat/COMPATIBILITY.md.

    python compat/run.py              # every release, then the report
    python compat/run.py 0.17.1       # one release (no report)

Releases are installed with ``pip install --no-deps --target compat/.cache/mcore-X`` so they
never touch the environment's own packages; the interpreter running this script supplies
torch, gemm_patch and the test tools.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "compat" / ".cache"
MATRIX = json.loads((ROOT / "compat" / "matrix.json").read_text())["releases"]
REPORT = ROOT / "compat" / "COMPATIBILITY.md"


@dataclass
class ReleaseResult:
    version: str
    expect: str
    expect_apex: str
    expect_te_overwrite: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    state: str = "?"
    apex_state: str = "?"
    te_overwrite_state: str = "?"

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.passed > 0


def release(version: str) -> dict:
    for entry in MATRIX:
        if entry["version"] == version:
            return entry
    raise SystemExit(f"megatron-core {version} is not in compat/matrix.json; "
                     f"known: {', '.join(e['version'] for e in MATRIX)}")


def ensure_release(version: str) -> Path:
    """Install megatron-core==version (without dependencies) into its own folder, once."""
    target = CACHE / f"mcore-{version}"
    marker = target / ".complete"
    if marker.exists():
        return target
    entry = release(version)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
           "--target", str(target), *entry["install"], f"megatron-core=={version}"]
    subprocess.run(cmd, check=True)
    marker.write_text(version)
    return target


def release_env(version: str) -> dict[str, str]:
    """Environment for a child interpreter that imports this release and gemm_patch from here."""
    env = dict(os.environ)
    path = [str(ensure_release(version)), str(ROOT)]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["GEMM_PATCH_EXPECT"] = release(version)["expect"]
    env["GEMM_PATCH_EXPECT_APEX"] = release(version)["expect_apex"]
    env["GEMM_PATCH_EXPECT_TE_OVERWRITE"] = release(version)["expect_te_overwrite"]
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_release(version: str, extra_args: tuple[str, ...] = ()) -> ReleaseResult:
    entry = release(version)
    result = ReleaseResult(version, entry["expect"], entry["expect_apex"], entry["expect_te_overwrite"])
    junit = CACHE / f"junit-{version}.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    env = release_env(version)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(ROOT / "tests" / "megatron"), "-q", "-p", "no:cacheprovider",
         f"--junitxml={junit}", *extra_args],
        env=env, cwd=ROOT, capture_output=True, text=True,
    )
    result.seconds = time.perf_counter() - start
    if not junit.exists():
        result.failed = 1
        result.failures.append(proc.stdout[-2000:] + proc.stderr[-2000:])
        return result
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            result.failed += 1
            result.failures.append(case.get("name", "?"))
        elif case.find("skipped") is not None:
            result.skipped += 1
        else:
            result.passed += 1
    state = subprocess.run(
        [sys.executable, "-c", "import json, gemm_patch, megatron.core.tensor_parallel.layers\n"
         "try:\n    import megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp\n"
         "except ImportError:\n    pass\n"
         "print(json.dumps({t.name: t.state for t in gemm_patch.status().targets}))"],
        env=env, cwd=ROOT, capture_output=True, text=True,
    )
    states = json.loads(state.stdout) if state.returncode == 0 else {}
    result.state = states.get("fsdp-wgrad", "import failed")
    result.apex_state = states.get("apex-wgrad", "import failed")
    result.te_overwrite_state = states.get("fsdp-te-overwrite", "import failed")
    if proc.returncode != 0 and not result.failures:
        result.failed += 1
        result.failures.append(proc.stdout[-2000:])
    return result


def write_report(results: list[ReleaseResult]) -> None:
    import torch

    import gemm_patch

    lines = [
        "# Compatibility report",
        "",
        "Generated by `python compat/run.py` (also run by `pytest tests/test_matrix.py`); do not edit.",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- gemm-patch {gemm_patch.__version__}, torch {torch.__version__}, "
        f"Python {platform.python_version()}, {platform.machine()}, CPU only",
        "- per release: unpatched crash reproduced, patched fp32 main_grad against fp64 (1e-6), "
        "bitwise forward/dgrad/bf16 main_grad, revert by identity, import order, strict mode",
        "- apex (no apex installed): Column/RowParallelLinear built with gradient_accumulation_fusion "
        "through the stand-in, megatron's own error when switched off or reverted, fp32 main_grad "
        "over two passes against fp64 (1e-6), bf16 main_grad in bf16, deferred embedding wgrad, "
        "a (simulated) real apex used untouched",
        "- fsdp-te-overwrite: Megatron-FSDP's own all_gather_and_wait_parameters_ready run through the "
        "wrapper (overwrite_main_grad reset for persistent buffers, kept for sharded multi-rank ones), "
        "revert by identity, GEMM_PATCH_TE_OVERWRITE=0, summary lines, strict mode",
        "",
        "| megatron-core | expected | fsdp-wgrad state | apex expected | apex-wgrad state "
        "| te-overwrite expected | fsdp-te-overwrite state | tests passed | failed | skipped | time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r.version} | {r.expect} | {r.state} | {r.expect_apex} | {r.apex_state} | "
                     f"{r.expect_te_overwrite} | {r.te_overwrite_state} | "
                     f"{r.passed} | {r.failed} | {r.skipped} | {r.seconds:.1f} |")
    failures = [f"- {r.version}: {', '.join(r.failures)}" for r in results if r.failures]
    if failures:
        lines += ["", "## Failures", "", *failures]
    REPORT.write_text("\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    versions = argv or [e["version"] for e in MATRIX]
    results = []
    for version in versions:
        r = run_release(version)
        results.append(r)
        print(f"megatron-core {version:<8} {'ok ' if r.ok else 'FAIL'} state={r.state} apex={r.apex_state} "
              f"te-overwrite={r.te_overwrite_state} "
              f"passed={r.passed} failed={r.failed} skipped={r.skipped} ({r.seconds:.1f}s)", flush=True)
        for failure in r.failures:
            print("   ", failure)
    if not argv:
        write_report(results)
        print(f"wrote {REPORT.relative_to(ROOT)}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
