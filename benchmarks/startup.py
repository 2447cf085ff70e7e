"""Interpreter start-up cost of gemm_patch's zero-code entry points on this machine.

Builds the wheel from this source tree (offline, with hatchling from this environment) and
makes two fresh venvs that differ only by it: one with the wheel installed (so with its
``gemm_patch_auto.pth``), one without. Both see this environment's packages (wrapt, ...) the
same way, through a path-only .pth file. Then times ``python -c pass`` in each configuration,
round-robin so drift hits all alike, and reports medians:

    plain venv (no .pth)                      the baseline
    wheel, GEMM_PATCH_AUTO unset              what the .pth costs every interpreter (< 5 ms)
    wheel, GEMM_PATCH_AUTO=1                  start-up with the patch applied
    wheel, under gemm-patch run               bootstrap sitecustomize + GEMM_PATCH_AUTO=1

It also checks that, with the variable unset, the interpreter imports exactly the modules
the plain venv imports (all standard library), by sys.modules and by ``-X importtime``.

    python benchmarks/startup.py [--runs 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gemm_patch.launcher import launch_env  # noqa: E402

MODULES = "import sys, json; print(json.dumps(sorted(sys.modules)))"


def build_venvs(tmp: Path) -> tuple[Path, Path]:
    """(python with the wheel, python without), the same in every other respect."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), str(ROOT)], check=True)
    wheel = next((tmp / "dist").glob("gemm_patch-*.whl"))
    pythons = []
    for name in ("with-wheel", "plain"):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / name)], check=True)
        python = tmp / name / "bin" / "python"
        purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        Path(purelib, "a_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        pythons.append(python)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(pythons[0]), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True)
    return pythons[0], pythons[1]


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH") and k != "PYTHONPATH"}
    env.pop("PYTHONSTARTUP", None)
    return env


def time_once(python: Path, env: dict[str, str], cwd: str) -> float:
    start = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], env=env, cwd=cwd, check=True)
    return (time.perf_counter() - start) * 1e3


def non_stdlib(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] not in sys.stdlib_module_names | {"__main__"}]


def importtime_modules(python: Path, env: dict[str, str], cwd: str) -> list[str]:
    out = subprocess.run([str(python), "-X", "importtime", "-c", "pass"], env=env, cwd=cwd,
                         capture_output=True, text=True, check=True)
    return [line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines()
            if line.startswith("import time:") and "|" in line and "imported package" not in line]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        with_wheel, plain = build_venvs(Path(tmp))
        off, auto = base_env(), {**base_env(), "GEMM_PATCH_AUTO": "1"}
        configs = {
            "plain venv (no .pth)": (plain, off),
            "wheel, GEMM_PATCH_AUTO unset": (with_wheel, off),
            "wheel, GEMM_PATCH_AUTO=1": (with_wheel, auto),
            "wheel, under gemm-patch run": (with_wheel, launch_env(off)),
        }
        for python, env in configs.values():  # warm the page cache and .pyc files
            for _ in range(3):
                time_once(python, env, tmp)
        samples: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.runs):
            for name, (python, env) in configs.items():
                samples[name].append(time_once(python, env, tmp))

        modules_plain = json.loads(subprocess.run([str(plain), "-c", MODULES], env=off, cwd=tmp,
                                                  capture_output=True, text=True, check=True).stdout)
        modules_off = json.loads(subprocess.run([str(with_wheel), "-c", MODULES], env=off, cwd=tmp,
                                                capture_output=True, text=True, check=True).stdout)
        modules_auto = json.loads(subprocess.run([str(with_wheel), "-c", MODULES], env=auto, cwd=tmp,
                                                 capture_output=True, text=True, check=True).stdout)
        importtime_off = importtime_modules(with_wheel, off, tmp)
        importtime_plain = importtime_modules(plain, off, tmp)

    baseline = statistics.median(samples["plain venv (no .pth)"])
    rows = []
    print(f"`python -c pass`, median of {args.runs} runs each (Python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs)\n")
    print("| configuration                 | median (ms) | vs. plain (ms) |")
    print("|-------------------------------|-------------|----------------|")
    for name, values in samples.items():
        median = statistics.median(values)
        rows.append({"configuration": name, "median_ms": median, "delta_ms": median - baseline})
        print(f"| {name:<29} | {median:>11.1f} | {median - baseline:>+14.1f} |")

    same = modules_off == modules_plain and importtime_off == importtime_plain
    extra = sorted(set(non_stdlib(modules_auto)))
    print(f"\nGEMM_PATCH_AUTO unset: sys.modules {'identical to' if modules_off == modules_plain else 'DIFFERS from'}"
          f" the plain venv ({len(modules_off)} modules, non-stdlib: {non_stdlib(modules_off) or 'none'}); "
          f"-X importtime lists {'the same' if importtime_off == importtime_plain else 'DIFFERENT'} imports")
    print(f"GEMM_PATCH_AUTO=1: {len(modules_auto) - len(modules_plain)} more modules, non-stdlib: "
          f"{', '.join(sorted({m.split('.')[0] for m in extra}))}; torch imported: {'torch' in modules_auto}")
    unset_delta = rows[1]["delta_ms"]
    verdict = unset_delta < 5 and same
    print(f"budget (< 5 ms, stdlib only, with the variable unset): {'met' if verdict else 'NOT MET'}")
    if args.json:
        args.json.write_text(json.dumps({"runs": args.runs, "rows": rows, "unset_imports_identical": same,
                                         "auto_non_stdlib": extra}, indent=2))
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
