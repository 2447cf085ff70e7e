"""Interpreter start-up cost of gemm_patch's zero-code entry points on this machine.

Builds the wheel from this source tree (offline, with hatchling from this environment) and
makes fresh venvs that differ only by it: one with the wheel installed (so with its
``gemm_patch_auto.pth``), one without, and with ``--old REF`` one with the wheel built from
that git revision (say the last 0.1 commit, whose switch imported gemm_patch eagerly). All
see this environment's packages (wrapt, ...) the same way, through a path-only .pth file.

Two kinds of process are timed, each in every configuration:

    python -c pass                 a process that never imports megatron: what the switch
                                   costs every interpreter of the environment
    python -c "import megatron.core"   with an empty fake ``megatron.core`` (a namespace
                                   ``megatron`` as megatron-core ships it): what loading and
                                   applying gemm_patch costs a process that does import it,
                                   without megatron's and torch's own seconds of noise

Configurations: plain venv (no .pth), wheel with GEMM_PATCH_AUTO unset, wheel with
GEMM_PATCH_AUTO=1, wheel under ``gemm-patch run``; for the megatron process also "explicit
``import gemm_patch`` first" (unset switch), the order 0.1's eager switch had. ``--megatron
DIR`` adds the real ``import megatron.core.tensor_parallel.layers`` from DIR (``--megatron-runs``
times; it imports torch, so each run takes seconds).

Every round runs every case once, in a fresh random order, so drift and neighbours' load hit all
alike; the budget is judged on paired differences (per round, then the median), which is what
``GEMM_PATCH_AUTO=1`` costs over the unset switch in the same moment. It also checks which
modules each configuration has loaded at exit (by sys.modules and ``-X importtime``).

    python -m benchmarks.startup [--runs 40] [--old REF] [--megatron DIR] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from gemm_patch.commands.launcher import launch_env  # noqa: E402

BUDGET_MS = 5.0
MODULES = "import sys, json; print(json.dumps(sorted(sys.modules)))"
FAKE_IMPORT = "import megatron.core"
REAL_IMPORT = "import megatron.core.tensor_parallel.layers"
HOOK_MODULES = ("_gemm_patch_startup", "sitecustomize")
HOOKED = ("GEMM_PATCH_AUTO=1", "gemm-patch run")


def build_wheel(source: Path, dist: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(source)], check=True)
    return next(dist.glob("gemm_patch-*.whl"))


def purelib(python: Path) -> Path:
    return Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())


def make_venv(path: Path, wheel: Path | None) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    (purelib(python) / "a_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if wheel is not None:  # pip compiles the .pyc files, as in any install
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                        "--no-index", str(wheel)], check=True)
    return python


def old_source(ref: str, tmp: Path) -> Path:
    """The source tree at git revision ``ref``, unpacked under ``tmp``."""
    archive = tmp / "old.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), ref], check=True)
    target = tmp / "old-src"
    with tarfile.open(archive) as tar:
        tar.extractall(target)
    return target


def base_env(*path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH") and k != "PYTHONPATH"}
    env.pop("PYTHONSTARTUP", None)
    env["PYTHONWARNINGS"] = "ignore"
    if path:
        env["PYTHONPATH"] = os.pathsep.join(map(str, path))
    return env


def under_run(env: dict[str, str], python: Path) -> dict[str, str]:
    """The environment that the ``gemm-patch run`` installed in ``python``'s venv gives its
    command: launch_env's, with that install's bootstrap directory (compiled, as installed)."""
    bootstrap = purelib(python) / "gemm_patch" / "bootstrap"
    assert (bootstrap / "sitecustomize.py").is_file(), bootstrap
    launched = launch_env(env)
    entries = launched["PYTHONPATH"].split(os.pathsep)
    return {**launched, "PYTHONPATH": os.pathsep.join([str(bootstrap), *entries[1:]])}


def time_once(python: Path, env: dict[str, str], code: str, cwd: str) -> tuple[float, float]:
    """(wall-clock ms, CPU ms) of one process. The CPU time (user + system, from the child's
    rusage) hardly moves with the machine's load; the wall-clock time is what a user waits."""
    start = time.perf_counter()
    proc = subprocess.Popen([str(python), "-c", code], env=env, cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = (time.perf_counter() - start) * 1e3
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, [str(python), "-c", code])
    return wall, (usage.ru_utime + usage.ru_stime) * 1e3


def loaded(python: Path, env: dict[str, str], cwd: str, code: str = "") -> list[str]:
    out = subprocess.run([str(python), "-c", f"{code}\n{MODULES}"], env=env, cwd=cwd,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def non_stdlib(modules: list[str]) -> list[str]:
    return sorted({m.split(".")[0] for m in modules} - set(sys.stdlib_module_names) - {"__main__"})


def importtime_modules(python: Path, env: dict[str, str], cwd: str) -> list[str]:
    out = subprocess.run([str(python), "-X", "importtime", "-c", "pass"], env=env, cwd=cwd,
                         capture_output=True, text=True, check=True)
    return [line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines()
            if line.startswith("import time:") and "|" in line and "imported package" not in line]


def hook_import_us(python: Path, env: dict[str, str], cwd: str) -> float:
    """Microseconds ``-X importtime`` gives the start-up hook's own modules (cumulative):
    ``_gemm_patch_startup`` (the .pth's) and the launcher's ``sitecustomize``."""
    out = subprocess.run([str(python), "-X", "importtime", "-c", "pass"], env=env, cwd=cwd,
                         capture_output=True, text=True, check=True)
    total = 0.0
    for line in out.stderr.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[2].strip() in HOOK_MODULES:
            total += float(parts[1])
    return total


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="rounds (each case once per round)")
    parser.add_argument("--old", metavar="REF", help="also time the wheel built from this git revision")
    parser.add_argument("--megatron", type=Path, metavar="DIR", help="a megatron-core install (pip --target)")
    parser.add_argument("--megatron-runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                        help="writes startup_cpu.json and startup_cpu.md here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        fake = tmp / "fake-megatron"
        (fake / "megatron" / "core").mkdir(parents=True)
        (fake / "megatron" / "core" / "__init__.py").write_text("")
        new = make_venv(tmp / "with-wheel", build_wheel(ROOT, tmp / "dist"))
        plain = make_venv(tmp / "plain", None)
        old = None
        if args.old:
            old = make_venv(tmp / "old-wheel", build_wheel(old_source(args.old, tmp), tmp / "dist-old"))

        off, auto = base_env(), {**base_env(), "GEMM_PATCH_AUTO": "1"}
        m_off, m_auto = base_env(fake), {**base_env(fake), "GEMM_PATCH_AUTO": "1"}
        # (group, configuration) -> (python, env, code)
        cases: dict[tuple[str, str], tuple[Path, dict[str, str], str]] = {
            ("pass", "plain venv"): (plain, off, "pass"),
            ("pass", "switch unset"): (new, off, "pass"),
            ("pass", "GEMM_PATCH_AUTO=1"): (new, auto, "pass"),
            ("pass", "gemm-patch run"): (new, under_run(off, new), "pass"),
            ("fake", "plain venv"): (plain, m_off, FAKE_IMPORT),
            ("fake", "switch unset, explicit import gemm_patch first"): (new, m_off, "import gemm_patch\n"
                                                                          + FAKE_IMPORT),
            ("fake", "GEMM_PATCH_AUTO=1"): (new, m_auto, FAKE_IMPORT),
            ("fake", "gemm-patch run"): (new, under_run(m_off, new), FAKE_IMPORT),
        }
        if old is not None:
            cases[("pass", f"{args.old} GEMM_PATCH_AUTO=1")] = (old, auto, "pass")
            cases[("pass", f"{args.old} gemm-patch run")] = (old, under_run(off, old), "pass")
            cases[("fake", f"{args.old} GEMM_PATCH_AUTO=1")] = (old, m_auto, FAKE_IMPORT)
        real: dict[tuple[str, str], tuple[Path, dict[str, str], str]] = {}
        if args.megatron:
            r_off = base_env(args.megatron.resolve())
            real = {
                ("real", "plain venv"): (plain, r_off, REAL_IMPORT),
                ("real", "switch unset, explicit import gemm_patch first"): (new, r_off, "import gemm_patch\n"
                                                                              + REAL_IMPORT),
                ("real", "GEMM_PATCH_AUTO=1"): (new, {**r_off, "GEMM_PATCH_AUTO": "1"}, REAL_IMPORT),
            }

        # What each configuration has loaded; also checks that every case runs at all.
        modules = {key: loaded(python, env, tmpdir, "" if code == "pass" else code)
                   for key, (python, env, code) in cases.items()}
        importtime_same = importtime_modules(new, off, tmpdir) == importtime_modules(plain, off, tmpdir)

        for python, env, code in [*cases.values(), *real.values()]:  # page cache, .pyc files
            for _ in range(2 if code == REAL_IMPORT else 3):
                time_once(python, env, code, tmpdir)
        rng = random.Random(args.seed)
        samples: dict[tuple[str, str], list[float]] = {key: [] for key in [*cases, *real]}
        cpu: dict[tuple[str, str], list[float]] = {key: [] for key in [*cases, *real]}
        hook_us: dict[str, list[float]] = {name: [] for name in HOOKED}
        for round_ in range(max(args.runs, args.megatron_runs if real else 0)):
            keys = [k for k in cases if round_ < args.runs] + [k for k in real if round_ < args.megatron_runs]
            rng.shuffle(keys)
            for key in keys:
                python, env, code = cases.get(key) or real[key]
                wall, cpu_ms = time_once(python, env, code, tmpdir)
                samples[key].append(wall)
                cpu[key].append(cpu_ms)
            if round_ < args.runs:
                for name in HOOKED:
                    python, env, _ = cases[("pass", name)]
                    hook_us[name].append(hook_import_us(python, env, tmpdir))
    load_after = os.getloadavg()

    def paired(a: tuple[str, str], b: tuple[str, str], data: dict = samples) -> dict[str, float]:
        diffs = [x - y for x, y in zip(data[a], data[b], strict=True)]
        q1, med, q3 = quartiles(diffs)
        return {"minus": b[1], "median_ms": med, "q1_ms": q1, "q3_ms": q3, "n": len(diffs)}

    rows = []
    references = {"pass": [("pass", "switch unset"), ("pass", "plain venv")],
                  "fake": [("fake", "plain venv")], "real": [("real", "plain venv")]}
    for key, values in samples.items():
        q1, med, q3 = quartiles(values)
        rows.append({"process": key[0], "configuration": key[1], "runs": len(values), "median_ms": med,
                     "q1_ms": q1, "q3_ms": q3,
                     "paired": [paired(key, ref) for ref in references[key[0]] if ref != key],
                     "cpu_median_ms": statistics.median(cpu[key]),
                     "cpu_paired": [paired(key, ref, cpu) for ref in references[key[0]][:1] if ref != key],
                     "non_stdlib_modules": non_stdlib(modules[key]) if key in modules else None,
                     "wrapt_loaded": ("wrapt" in modules[key]) if key in modules else None,
                     "gemm_patch_loaded": ("gemm_patch" in modules[key]) if key in modules else None})

    lazy = paired(("pass", "GEMM_PATCH_AUTO=1"), ("pass", "switch unset"))["median_ms"]
    lazy_run = paired(("pass", "gemm-patch run"), ("pass", "switch unset"))["median_ms"]
    lazy_cpu = paired(("pass", "GEMM_PATCH_AUTO=1"), ("pass", "switch unset"), cpu)["median_ms"]
    lazy_run_cpu = paired(("pass", "gemm-patch run"), ("pass", "switch unset"), cpu)["median_ms"]
    unset_same = modules[("pass", "switch unset")] == modules[("pass", "plain venv")] and importtime_same
    nothing_loaded = not any(m in modules[("pass", c)] for c in ("GEMM_PATCH_AUTO=1", "gemm-patch run")
                             for m in ("wrapt", "gemm_patch"))
    verdict = lazy <= BUDGET_MS and lazy_run <= BUDGET_MS and unset_same and nothing_loaded
    result = {
        "date": started.isoformat(timespec="seconds"), "python": sys.version.split()[0],
        "platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_before": load_before,
        "loadavg_after": load_after, "runs": args.runs, "megatron_runs": args.megatron_runs if real else 0,
        "old": args.old, "megatron": str(args.megatron) if args.megatron else None, "budget_ms": BUDGET_MS,
        "auto_minus_unset_ms": lazy, "run_minus_unset_ms": lazy_run,
        "auto_minus_unset_cpu_ms": lazy_cpu, "run_minus_unset_cpu_ms": lazy_run_cpu,
        "unset_imports_identical_to_plain": unset_same, "no_wrapt_no_gemm_patch_without_megatron": nothing_loaded,
        "budget_met": verdict, "rows": rows,
        "hook_import_us": {name: dict(zip(("q1", "median", "q3"), quartiles(v), strict=True))
                           for name, v in hook_us.items()},
    }
    text = render(result)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "startup_cpu.md").write_text(text)
    return 0 if verdict else 1


PROCESS = {"pass": "`python -c pass` (never imports megatron)",
           "fake": "`python -c \"import megatron.core\"` (an empty fake megatron.core)",
           "real": "`python -c \"import megatron.core.tensor_parallel.layers\"` (real megatron-core, imports torch)"}


def render(result: dict) -> str:
    lines = [f"# Start-up cost of gemm_patch's zero-code entry points ({result['date']})", "",
             f"`python -m benchmarks.startup --runs {result['runs']}"
             + (f" --old {result['old']}" if result["old"] else "")
             + (f" --megatron {result['megatron']} --megatron-runs {result['megatron_runs']}"
                if result["megatron"] else "") + "`",
             "",
             f"Python {result['python']}, {result['cpus']} CPUs ({result['platform']}); load average "
             f"{result['loadavg_before'][0]:.1f} before, {result['loadavg_after'][0]:.1f} after (a shared machine: "
             "other jobs ran too, which is why every comparison below is paired within a round). Times are "
             "wall-clock per process, subprocess start included, and the process's CPU time (user + system, "
             "from its rusage: far less sensitive to the machine's load); quartiles in brackets.", ""]
    for process in ("pass", "fake", "real"):
        rows = [r for r in result["rows"] if r["process"] == process]
        if not rows:
            continue
        refs = list(dict.fromkeys(p["minus"] for r in rows for p in r["paired"]))
        lines += [f"## {PROCESS[process]}, {rows[0]['runs']} runs each", "",
                  "| configuration | median (ms) | " + " | ".join(f"paired vs. {r} (ms)" for r in refs)
                  + f" | CPU median (ms) | CPU paired vs. {refs[0]} (ms) | non-stdlib modules loaded |",
                  "|---|---|" + "---|" * len(refs) + "---|---|---|"]
        for row in rows:
            cells = []
            for ref in refs:
                p = next((p for p in row["paired"] if p["minus"] == ref), None)
                cells.append(f"{p['median_ms']:+.1f} [{p['q1_ms']:+.1f}, {p['q3_ms']:+.1f}]" if p else "")
            mods = row["non_stdlib_modules"]
            shown = "n/a" if mods is None else (", ".join(m for m in mods if m in ("wrapt", "gemm_patch",
                                                                                   "_gemm_patch_startup",
                                                                                   "sitecustomize", "megatron",
                                                                                   "torch")) or "none")
            c = row["cpu_paired"][0] if row["cpu_paired"] else None
            cpu_cell = f"{c['median_ms']:+.1f} [{c['q1_ms']:+.1f}, {c['q3_ms']:+.1f}]" if c else ""
            lines.append(f"| {row['configuration']} | {row['median_ms']:.1f} [{row['q1_ms']:.1f}, "
                         f"{row['q3_ms']:.1f}] | " + " | ".join(cells)
                         + f" | {row['cpu_median_ms']:.1f} | {cpu_cell} | {shown} |")
        lines.append("")
    hook = result["hook_import_us"]
    lines += ["The start-up hook's own modules (`_gemm_patch_startup`, and under `gemm-patch run` the bootstrap "
              "`sitecustomize`), as `-X importtime` reports them (cumulative, median of "
              f"{result['runs']} [quartiles]): "
              + "; ".join(f"{name}: {v['median']:.0f} us [{v['q1']:.0f}, {v['q3']:.0f}]" for name, v in hook.items())
              + ". This is the low-noise part of the cost; the paired wall-clock differences above also carry the "
              "noise of a shared machine.", ""]
    lines += [f"- `GEMM_PATCH_AUTO=1` over the unset switch, `python -c pass`, paired median: "
              f"{result['auto_minus_unset_ms']:+.1f} ms; under `gemm-patch run`: "
              f"{result['run_minus_unset_ms']:+.1f} ms (budget {result['budget_ms']:.0f} ms); "
              f"in CPU time (user + system): {result['auto_minus_unset_cpu_ms']:+.1f} ms and "
              f"{result['run_minus_unset_cpu_ms']:+.1f} ms",
              f"- switch unset: sys.modules and `-X importtime` identical to the plain venv: "
              f"{'yes' if result['unset_imports_identical_to_plain'] else 'NO'}",
              f"- `python -c pass` with the switch on loads neither wrapt nor gemm_patch: "
              f"{'yes' if result['no_wrapt_no_gemm_patch_without_megatron'] else 'NO'}",
              f"- budget: {'met' if result['budget_met'] else 'NOT MET'}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
