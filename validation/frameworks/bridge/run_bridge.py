#!/usr/bin/env python
"""Megatron-Bridge on Megatron-FSDP, unpatched and under ``gemm-patch run``, on one 2-GPU machine:
one Bridge/megatron-core pairing per run, every result in one JSON.

    python3 -m validation.frameworks.bridge.run_bridge --tests .bw62/bt --test-path \\
        tests/functional_tests/test_groups/megatron_fsdp --out $OUT/bridge_0.6.2.json --budget 480

The environment (TE, megatron-core, Bridge and its import set on PYTHONPATH) is the caller's: see
validation/frameworks/bridge/README.md. Jobs, each ``torchrun --nproc_per_node 2`` on its own port:

- wave 1, all at once (the GPUs are shared; step times of this wave are marked ``concurrent``):
  ``unpatched`` (fusion at Bridge's default, step-1 gradient dump), ``patched`` (the same under
  ``python -m gemm_patch run``), ``off`` and ``off_repeat`` (fusion off, unpatched: the reference and
  its run-to-run noise), and Bridge's own Megatron-FSDP functional tests unpatched and patched
  (copied to /tmp, fusion switched on, fp32 main grads where megatron-core has the field);
- wave 2, alone, when at least 110 s are left: ``patched_timing`` (no dump), for ``median_step_ms``.

Gradient parity: per parameter rel = ||g - g_off|| / ||g_off|| (validation/parity/compare_grads.py), pass
when rel <= max(2^-7, 3 x rel(off_repeat, off)), the bound of validation/parity/run_coverage.py. Every job
has a timeout inside --budget; the JSON is rewritten (atomically) after each stage, so a cut-off run
leaves what it had, and each stage after wave 1 runs on its own (``postprocess``, ``guarded``): an
unreadable result of one job stops none of the others. Logs go to /tmp/br/*.log and, compressed,
next to the JSON (--logs); merge_results.py rebuilds a stopped driver's record from them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from validation.frameworks.bridge.bridge_pretrain import write_atomic

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

WORK = Path("/tmp/br")
NOISE_FACTOR, BOUND = 3.0, 2.0 ** -7
T0 = time.monotonic()


def left(budget: float) -> float:
    return budget - (time.monotonic() - T0)


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)  # Bridge asserts != 1 for Megatron-FSDP
    env.update({
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled", "WANDB_DISABLED": "true", "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "4",
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    return env


def fix_compile_helpers(env: dict[str, str], notes: list[str]) -> None:
    """Bridge's initialize calls megatron-core's compile_helpers() (``make -C megatron/core/datasets``)
    and sys.exit(1)s when it fails; the wheels ship the prebuilt helpers_cpp .so but no Makefile."""
    code = "import os, megatron.core.datasets as d; print(os.path.dirname(d.__file__))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    ddir = Path(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
    if ddir is None:
        notes.append(f"megatron.core.datasets did not import: {r.stderr[-500:]}")
        return
    so = sorted(p.name for p in ddir.glob("helpers_cpp*.so"))
    if not (ddir / "Makefile").exists():
        (ddir / "Makefile").write_text("# gemm-patch validation/frameworks/bridge: helpers_cpp ships prebuilt\n"
                                       "all:\n\t@true\n")
        notes.append(f"wrote a no-op Makefile in {ddir} (prebuilt: {so})")
    if shutil.which("make", path=env.get("PATH")) is None:
        shim = Path("/tmp/br/shim")
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "make").write_text("#!/bin/sh\nexit 0\n")
        (shim / "make").chmod(0o755)
        env["PATH"] = f"{shim}:{env.get('PATH', '')}"
        notes.append("no make on PATH: a shim that exits 0 (helpers_cpp is prebuilt)")


def prepare_tests(src: Path, test_path: str, notes: list[str]) -> Path:
    """Copy Bridge's tests to /tmp/br/bt and turn fusion on (+ fp32 main grads on 0.19+)."""
    dst = WORK / "bt"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    files = [dst / test_path] if (dst / test_path).is_file() else sorted((dst / test_path).rglob("test_*.py"))
    for f in files:
        s = f.read_text()
        n_fusion = s.count("gradient_accumulation_fusion: bool = False")
        s = s.replace("gradient_accumulation_fusion: bool = False", "gradient_accumulation_fusion: bool = True")
        m = re.search(r"def create_base_ddp_config\(.*?\n(\s+)base_config\.update\(kwargs\)", s, re.S)
        if m:
            ind = m.group(1).strip("\n")
            field = "'megatron_fsdp_main_grads_dtype'"
            ins = (f"{ind}if {field} in DistributedDataParallelConfig.__dataclass_fields__:  # gemm-patch\n"
                   f"{ind}    base_config[{field}] = torch.float32\n")
            s = s[: m.start(1)] + "\n" + ins + s[m.start(1):].lstrip("\n")
        f.write_text(s)
        notes.append(f"{f.relative_to(dst)}: fusion default False->True x{n_fusion}; "
                     f"fp32 main grads in create_base_ddp_config: {'yes' if m else 'not found'}")
    return dst


class Job:
    def __init__(self, name: str, cmd: list[str], cwd: Path, env: dict[str, str], port: int):
        self.name, self.cmd, self.cwd, self.env = name, cmd, cwd, dict(env)
        self.env["MASTER_PORT"] = str(port)
        self.log = WORK / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.rc: int | None = None
        self.timed_out = False
        self.t = 0.0
        self.wall = None

    def start(self) -> None:
        self.t = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def poll(self, deadline: float) -> bool:
        """True once finished (killed at the deadline: its whole process group)."""
        if self.rc is not None:
            return True
        rc = self.proc.poll()
        if rc is None and time.monotonic() < deadline:
            return False
        if rc is None:
            self.timed_out = True
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    pass
            rc = self.proc.poll()
        self.rc, self.wall = rc, round(time.monotonic() - self.t, 1)
        return True

    def summary(self) -> dict:
        return {"rc": self.rc, "timed_out": self.timed_out, "wall_s": self.wall, "cmd": " ".join(self.cmd)}


def run_all(jobs: list[Job], deadline: float) -> None:
    for j in jobs:
        j.start()
        time.sleep(1)
    while not all(j.poll(deadline) for j in jobs):
        time.sleep(2)


def torchrun(port: int) -> list[str]:
    """torchrun's launcher; what follows must be the training *script* (torchrun starts it with
    ``sys.executable`` itself), never an interpreter: see check_commands."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
            "--master_addr", "127.0.0.1", "--master_port", str(port)]


PATCH = [sys.executable, "-m", "gemm_patch", "run", "--"]
TORCHRUN_FLAGS = {"--standalone", "--no-python", "--no_python", "-m", "--module", "--run-path", "--run_path"}


def pretrain_cmd(port: int, name: str, iters: int, *extra: str) -> list[str]:
    # a script for torchrun (check_commands), whose package imports reach this checkout through
    # base_env's PYTHONPATH
    return [*torchrun(port), str(HERE / "bridge_pretrain.py"), "--iters", str(iters), "--out", str(WORK / name),
            *extra]


def build_jobs(a: argparse.Namespace, env: dict[str, str], bt: Path | None, skip: set[str]) -> list[Job]:
    """Wave 1: the four pretraining runs and, with ``bt`` (Bridge's prepared tests), its tests."""
    jobs = [
        Job("unpatched", pretrain_cmd(29501, "unpatched", a.iters, "--dump"), ROOT, env, 29501),
        Job("patched", [*PATCH, *pretrain_cmd(29502, "patched", a.iters, "--dump")], ROOT, env, 29502),
        Job("off", pretrain_cmd(29503, "off", a.iters, "--dump", "--fusion", "off"), ROOT, env, 29503),
        Job("off_repeat", pretrain_cmd(29504, "off_repeat", a.iters, "--dump", "--fusion", "off"), ROOT, env, 29504),
    ]
    if bt is not None:
        pyt = [str(HERE / "pytest_rank.py")]
        args = ["-v", "-s", "-rA", "-p", "no:cacheprovider", "-m", "not pleasefixme", "--tb=short", a.test_path]
        for i, (name, pre) in enumerate((("tests_unpatched", []), ("tests_patched", PATCH))):
            jobs.append(Job(name, [*pre, *torchrun(29511 + i), *pyt, str(WORK / name) + ".junit", *args],
                            bt, env, 29511 + i))
    return [j for j in jobs if j.name not in skip]


def timing_job(a: argparse.Namespace, env: dict[str, str]) -> Job:
    """Wave 2: the patched run alone, no dump, for median_step_ms."""
    return Job("patched_timing", [*PATCH, *pretrain_cmd(29505, "patched_timing", a.iters)], ROOT, env, 29505)


def check_commands(jobs: list[Job]) -> list[str]:
    """What would make a job die before it starts: torchrun's first positional argument must be an
    existing .py file (passing the interpreter there made all four
    pretraining runs of a 0.6.2 run die with 'SyntaxError: source code cannot contain null bytes'); gemm_patch run
    needs ``--`` and a command; ports distinct."""
    bad: list[str] = []
    ports: dict[str, str] = {}
    for j in jobs:
        c = j.cmd
        if j.env["MASTER_PORT"] in ports:
            bad.append(f"{j.name}: port {j.env['MASTER_PORT']} also used by {ports[j.env['MASTER_PORT']]}")
        ports[j.env["MASTER_PORT"]] = j.name
        if c[1:5] == ["-m", "gemm_patch", "run", "--"] and len(c) == 5:
            bad.append(f"{j.name}: 'gemm_patch run --' with no command")
        elif "gemm_patch" in c and c[c.index("gemm_patch") + 1:c.index("gemm_patch") + 3] != ["run", "--"]:
            bad.append(f"{j.name}: gemm_patch must be called as 'gemm_patch run -- COMMAND'")
        if "torch.distributed.run" not in c:
            bad.append(f"{j.name}: no torch.distributed.run")
            continue
        i = c.index("torch.distributed.run") + 1
        while i < len(c) and c[i].startswith("-"):
            if c[i] in ("--no-python", "--no_python", "-m", "--module"):
                bad.append(f"{j.name}: torchrun {c[i]} is not how these jobs run")
            i += 1 if "=" in c[i] or c[i] in TORCHRUN_FLAGS else 2
        if i >= len(c):
            bad.append(f"{j.name}: torchrun has no training script")
            continue
        script = Path(c[i]) if Path(c[i]).is_absolute() else j.cwd / c[i]
        if script.suffix != ".py":
            bad.append(f"{j.name}: torchrun's training script is {c[i]!r}, not a .py file "
                       "(torchrun runs it with python itself: pass the script, not an interpreter)")
        elif not script.is_file():
            bad.append(f"{j.name}: torchrun's training script {script} does not exist")
    return bad


def read_run(name: str, work: Path | None = None) -> dict:
    """A pretraining job's record: result.json (rank 0, success), else the first readable
    result.rankR.json. An empty or cut-off file (a rank killed while writing: torchrun SIGTERMs the
    other ranks when one fails, and a 0-byte result.rank0.json left that way once
    stopped the whole driver) is passed over and named in ``result_file_notes``; with none
    readable, the 'no result' record says why."""
    work = work or WORK
    d, notes = work / name, []
    for f in [d / "result.json", *sorted(d.glob("result.rank*.json"))]:
        if not f.exists():
            continue
        text = f.read_text(errors="replace")
        if not text.strip():
            notes.append(f"{f.name} is empty ({len(text)} bytes): the rank was killed while writing")
            continue
        try:
            r = json.loads(text)
        except json.JSONDecodeError as e:
            notes.append(f"{f.name} is cut off or not JSON ({len(text)} bytes, {e}): "
                         "the rank was killed while writing")
            continue
        if not isinstance(r, dict):
            notes.append(f"{f.name} holds no record ({type(r).__name__})")
            continue
        return {**r, "result_file_notes": notes} if notes else r
    log = work / f"{name}.log"
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    why = "; ".join(notes) if notes else "no result file (killed or crashed before writing)"
    return {"ok": False, "error": why, "log_tail": tail, **({"result_file_notes": notes} if notes else {})}


def first_error(log: Path) -> str | None:
    if not log.exists():
        return None
    text = log.read_text(errors="replace")
    hits = re.findall(r"^(?:\[rank\d+\]: )?((?:[A-Za-z_.]*Error|Exception)[^\n]*)$", text, re.M)
    hits = [h for h in hits if "ChildFailedError" not in h]  # torchrun's wrapper, never the cause
    return hits[0][:800] if hits else None


def failed_outcome(r: dict, log: Path) -> str:
    """A failed run in one line: its exception, where it was raised (the last two frames of its
    traceback) and, if the log shows another, the log's first error."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', r.get("traceback") or r.get("traceback_tail") or "")
    at = [f"{re.sub(r'^.*?/(?=megatron/)', '', f)}:{n} ({fn})" for f, n, fn in frames[-2:]]
    where = f" (raised at {at[-1]}, called from {at[0]})" if len(at) == 2 else f" (raised at {at[0]})" if at else ""
    fe = first_error(log)
    also = f" | first error in log: {fe}" if fe and fe.split(":")[0] not in (r.get("error") or "") else ""
    return f"{r.get('error')}{where}{also}"


def grad_parity(got: str, ref: str, rep: str | None, work: Path | None = None) -> dict:
    import torch

    from validation.parity.compare_grads import param_kind, relative

    def load(p):
        return torch.load(p, map_location="cpu", weights_only=False)["grads"]

    work = work or WORK
    g, r = load(work / got / "grads.pt"), load(work / ref / "grads.pt")
    n = load(work / rep / "grads.pt") if rep and (work / rep / "grads.pt").exists() else None
    rows = []
    for name in sorted(r):
        if name not in g:
            rows.append({"name": name, "missing": True, "rel": float("inf"), "bound": BOUND})
            continue
        rel, ratio = relative(g[name], r[name])
        noise = relative(n[name], r[name])[0] if n is not None and name in n else None
        bound = max(BOUND, NOISE_FACTOR * noise) if noise is not None else BOUND
        rows.append({"name": name, "kind": param_kind(name), "rel": rel, "ratio": ratio, "noise_rel": noise,
                     "bound": bound, "pass": rel <= bound})
    by_kind: dict = {}
    for x in rows:
        k = by_kind.setdefault(x.get("kind", "missing"), {"params": 0, "max_rel": 0.0, "failed": 0})
        k["params"] += 1
        k["max_rel"] = max(k["max_rel"], x["rel"])
        k["failed"] += 0 if x.get("pass") else 1
    worst = sorted(rows, key=lambda x: x["rel"] / x["bound"], reverse=True)[:8]
    return {"params": len(rows), "max_rel_diff": max((x["rel"] for x in rows), default=None),
            "passed": bool(rows) and all(x.get("pass") for x in rows), "failed": sum(not x.get("pass") for x in rows),
            "bound": f"max(2^-7, {NOISE_FACTOR:g} x rel(off_repeat, off))",
            "noise_max_rel": max((x["noise_rel"] or 0.0 for x in rows if "noise_rel" in x), default=None),
            "extra_in_got": sorted(set(g) - set(r)), "by_kind": by_kind, "worst": worst}


def read_tests(name: str, work: Path | None = None) -> dict:
    work = work or WORK
    out: dict = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "tests": {}}
    xml = work / f"{name}.junit.rank0.xml"
    if xml.exists():
        try:
            for tc in ET.parse(xml).getroot().iter("testcase"):
                kind = "passed"
                for child in tc:
                    if child.tag in ("failure", "error", "skipped"):
                        kind = {"failure": "failed", "error": "errors", "skipped": "skipped"}[child.tag]
                        out.setdefault("messages", {})[tc.get("name")] = (child.get("message") or "")[:600]
                out[kind] += 1
                out["tests"][tc.get("name")] = kind
                out.setdefault("time_s", {})[tc.get("name")] = float(tc.get("time") or "nan")
            out["source"] = "junit rank 0"
            return out
        except ET.ParseError as e:
            out["junit_error"] = str(e)
    log = work / f"{name}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    for test, outcome in re.findall(r"::(test_\w+) (PASSED|FAILED|SKIPPED|ERROR)", text):
        if test not in out["tests"]:
            key = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "errors"}[outcome]
            out["tests"][test] = key
            out[key] += 1
    out["source"] = "log (no junit: killed or crashed)"
    return out


RUNS = ("unpatched", "patched", "off", "off_repeat")


def guarded(res: dict, stage: str, fn, *args):
    """One post-processing stage: its exception goes to ``stage_errors`` and the next stage runs
    (one unreadable file must not cost gradient parity and patched_timing)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the other stages still run
        res.setdefault("stage_errors", {})[stage] = f"{type(e).__name__}: {e}"
        return None


def run_block(r: dict) -> dict:
    return {
        "ok": r.get("ok"), "error": r.get("error"), "losses": r.get("losses"),
        "median_step_ms_concurrent": r.get("median_step_ms"),
        "fusion_in_model": r.get("gradient_accumulation_fusion_in_model"),
        "steps": len(r.get("steps") or []), "import_s": r.get("import_s"), "wall_s": r.get("wall_s"),
        **({"traceback_tail": (r.get("traceback") or "")[-2500:]} if not r.get("ok") else {}),
        **{k: r[k] for k in ("gemm_patch_status", "log_tail", "result_file_notes") if r.get(k)},
    }


def max_abs_diff(a: list | None, b: list | None) -> float | None:
    if a and b and len(a) == len(b) and None not in a + b:
        return max(abs(x - y) for x, y in zip(a, b, strict=True))
    return None


def gemm_patch_lines(log: Path) -> list[str]:
    text = log.read_text(errors="replace") if log.exists() else ""
    return sorted(set(re.findall(r"\[gemm_patch\] [A-Z]+:[^\n]{0,300}", text)))[:12]


def postprocess(res: dict, work: Path, skip: set[str] = frozenset(), tests: bool = False,
                parity: bool = True) -> dict:
    """Everything wave 1 left in ``work``, into ``res``: each run's record, loss differences vs
    fusion off, gradient parity (``parity``: the grads.pt dumps are there), the unpatched outcome,
    Bridge's tests. Every stage is ``guarded``. merge_results.py runs it on a logs tgz too."""
    runs: dict = {}
    for n in (n for n in RUNS if n not in skip):
        runs[n] = guarded(res, f"read {n}", read_run, n, work) or {
            "ok": False, "error": f"result not read: {res['stage_errors'][f'read {n}']}"}
        res[n] = run_block(runs[n])
    if "patched" in res:
        res["patched"]["gemm_patch_lines"] = gemm_patch_lines(work / "patched.log")
    off = runs.get("off") or {}
    for n in ("unpatched", "patched"):
        if parity and (runs.get(n) or {}).get("ok") and off.get("ok"):
            rep = "off_repeat" if (runs.get("off_repeat") or {}).get("ok") else None
            gp = guarded(res, f"grad parity {n}", grad_parity, n, "off", rep, work)
            if gp is not None:
                (res if n == "patched" else res[n])["grad_parity"] = gp
        d = max_abs_diff((runs.get(n) or {}).get("losses"), off.get("losses"))
        if d is not None:
            res[n]["loss_max_abs_diff_vs_off"] = d
    d = max_abs_diff(off.get("losses"), (runs.get("off_repeat") or {}).get("losses"))
    if d is not None:
        res["off"]["loss_max_abs_diff_off_repeat"] = d

    u = runs.get("unpatched") or {}
    if not u:
        res["unpatched_outcome"] = "not run"
    elif not u.get("ok"):
        res["unpatched_outcome"] = guarded(res, "unpatched outcome", failed_outcome, u, work / "unpatched.log")
    else:
        gp = res["unpatched"].get("grad_parity") or {}
        res["unpatched_outcome"] = (
            f"trained {res['unpatched']['steps']} steps "
            f"(fusion in model: {u.get('gradient_accumulation_fusion_in_model')}); "
            f"step-1 gradients vs fusion off: {'pass' if gp.get('passed') else 'FAIL'} "
            f"(max rel {gp.get('max_rel_diff')}, worst {[x['name'] for x in gp.get('worst', [])[:3]]})")
    if tests:
        def tests_of(n: str) -> dict:
            return {} if n in skip else guarded(res, n, read_tests, n, work) or {}

        bt = res["bridge_tests"] = tests_of("tests_patched")
        bt["unpatched"] = tests_of("tests_unpatched")
        bt["gemm_patch_lines"] = gemm_patch_lines(work / "tests_patched.log")
    return runs


def timing_stage(a: argparse.Namespace, env: dict[str, str], skip: set[str], runs: dict, res: dict) -> None:
    """Wave 2: patched_timing alone for median_step_ms; without it, wave 1's concurrent median."""
    if "patched_timing" not in skip and left(a.budget) > 110 and (runs.get("patched") or {}).get("ok"):
        j = timing_job(a, env)
        run_all([j], T0 + a.budget - 10)
        res["jobs"][j.name] = j.summary()
        t = read_run("patched_timing")
        res["patched"]["median_step_ms"] = t.get("median_step_ms")
        res["patched"]["timing_losses"] = t.get("losses")
        res["patched"]["median_step_ms_source"] = "patched_timing, alone on the GPUs, steps 3+"
    elif "patched" in res:
        res["patched"]["median_step_ms"] = res["patched"].get("median_step_ms_concurrent")
        res["patched"]["median_step_ms_source"] = "wave 1, concurrent with 5 other jobs on the same GPUs"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="result JSON path (under $OUT); required unless --dry-run")
    p.add_argument("--logs", help="tar.gz of /tmp/br logs (under $OUT)")
    p.add_argument("--tests", help="folder holding Bridge's tests/ tree at the matching tag")
    p.add_argument("--test-path", default="tests/functional_tests/test_groups/megatron_fsdp")
    p.add_argument("--budget", type=float, default=480, help="seconds for everything this script does")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--skip", default="", help="comma list of jobs to leave out (e.g. tests_unpatched)")
    p.add_argument("--dry-run", action="store_true",
                   help="print every job's command and check it (no GPU, no imports, nothing written); "
                        "exit 1 on a bad command")
    a = p.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    if a.dry_run:
        jobs = build_jobs(a, dict(os.environ, PYTHONPATH=str(ROOT)), WORK / "bt" if a.tests else None, skip)
        if a.tests:  # the copy prepare_tests makes; its script is ours, so checkable without it
            print(f"(tests: {a.tests} copied to {WORK / 'bt'}, {a.test_path} fusion on)")
        for j in [*jobs, timing_job(a, {})]:
            print(f"{j.name} [cwd {j.cwd}]:\n  {' '.join(j.cmd)}")
        bad = check_commands([*jobs, timing_job(a, {})])
        print("\n".join(["command check: FAILED", *bad]) if bad else f"command check: ok ({len(jobs) + 1} jobs)")
        return 1 if bad else 0
    if not a.out:
        p.error("--out is required")
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res: dict = {"notes": [], "jobs": {}}

    def save() -> None:
        res["elapsed_s"] = round(time.monotonic() - T0, 1)
        write_atomic(out, json.dumps(res, indent=1, default=str))
        if a.logs:
            with tarfile.open(f"{a.logs}.tmp", "w:gz") as t:
                for f in sorted(WORK.glob("*.log")) + sorted(WORK.glob("*/result*.json")) + sorted(WORK.glob("*.xml")):
                    t.add(f, arcname=str(f.relative_to(WORK)))
            os.replace(f"{a.logs}.tmp", a.logs)

    try:
        env = base_env()
        code = ("import importlib.metadata as m, torch, megatron.core as c, megatron.bridge as b,"
                " transformer_engine as t;"
                "print(getattr(b, '__version__', None) or m.version('megatron-bridge'), c.__version__,"
                " t.__version__, torch.__version__, torch.cuda.device_count(), m.version('transformers'))")
        v = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
        if v.returncode != 0:
            res["unpatched_outcome"] = f"environment does not import: {v.stderr[-1500:]}"
            save()
            return 1
        bv, mc, te, tv, ngpu, tf = v.stdout.split()[-6:]
        res.update({"bridge_version": bv, "megatron_core": mc, "transformer_engine": te, "torch": tv,
                    "gpus": int(ngpu), "transformers": tf})
        fix_compile_helpers(env, res["notes"])
        bt = None
        if a.tests:
            bt = prepare_tests(Path(a.tests).resolve(), a.test_path, res["notes"])
            res["bridge_tests_source"] = f"Megatron-Bridge {a.test_path} (copied from {a.tests}), fusion on"
        jobs = build_jobs(a, env, bt, skip)
        res["jobs"] = {j.name: {"cmd": " ".join(j.cmd)} for j in jobs}
        bad = check_commands([*jobs, timing_job(a, env)])
        if bad:
            res["command_errors"] = bad
            save()
            return 1
        save()
        run_all(jobs, T0 + a.budget - 45)
        res["jobs"] = {j.name: j.summary() for j in jobs}

        runs = postprocess(res, WORK, skip, bool(a.tests))
        save()
        guarded(res, "patched_timing", timing_stage, a, env, skip, runs, res)
    except Exception as e:  # noqa: BLE001 - partial JSON is the point
        import traceback

        res["driver_error"] = f"{type(e).__name__}: {e}"
        res["driver_traceback"] = traceback.format_exc()[-3000:]
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
