#!/usr/bin/env python
"""Merge run_bridge.py's per-pairing JSONs into validation/results/bridge.json.

    python -m validation.frameworks.bridge.merge_results FILES_AT/bridge_0.4.2.json [FILES_AT/bridge_0.6.2.json] \\
        --source "2 x H200, DATE" [--fixed-in COMMIT] [--keep validation/results/bridge.json]

Top level: the first pairing with a measured gradient parity (else the first file's):
``bridge_version``, ``megatron_core``, ``unpatched_outcome``, ``patched`` {``losses``,
``median_step_ms``}, ``grad_parity`` {``params``, ``max_rel_diff``, ``passed``}, ``bridge_tests``
{``passed``, ``failed``, ``skipped``, ``unpatched``}, nulls where nothing was measured, each with
its reason. Every file is also kept under ``pairings`` (log tails cut to their last lines). Where
``logs_X.tgz`` lies beside ``bridge_X.json``, Bridge's test logs and JUnit files are read for
per-test durations, gemm_patch's status lines and the loss lines Bridge's training loop printed.

A pretraining job whose log shows a known harness failure (``HARNESS``) did not test Bridge:
its fields are null with ``not_run``; the unpatched outcome then comes from Bridge's own tests.
A file whose driver stopped before reading wave 1 (``driver_error``, no run records) is rebuilt
from its logs tgz with run_bridge.py's own ``postprocess`` (``recovered_from``); what needs files
the tgz does not carry (the gradient dumps, patched_timing) stays null with the reason.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from validation.frameworks.bridge import run_bridge as rb

OUT = Path(__file__).resolve().parents[2] / "results" / "bridge.json"
HARNESS = {
    "source code cannot contain null bytes": (
        "harness bug: run_bridge.py passed the Python interpreter as torchrun's training script "
        "(torchrun runs its first positional argument with python itself), so the job died in ~5 s "
        "with 'SyntaxError: source code cannot contain null bytes' before importing Bridge"),
}
DRIVER_FIXED = {  # a driver stop (exception, function) whose cause is fixed: how, and the tests that pin it
    ("JSONDecodeError", "read_run"): (
        "read_run() passes over an empty or cut-off rank file and falls back to the next one or to the "
        "'no result' record with the reason, every post-processing stage runs on its own (run_bridge.guarded), "
        "bridge_pretrain.py writes its result files atomically; validation/tests/test_bridge_harness.py::"
        "test_read_run_passes_over_an_empty_rank0_file, ::test_read_run_with_only_an_unreadable_file, "
        "::test_one_unreadable_result_stops_no_stage"),
}
RUNS = rb.RUNS
CHECKS = {  # Bridge's tests/functional_tests/test_groups/megatron_fsdp/test_megatron_fsdp.py (v0.6.0; v0.4.2's
    # test_groups/training/test_megatron_fsdp.py runs only the first, its other two are marked pleasefixme)
    "test_fsdp_pretrain_basic": "pretrain() for 10 iterations completes (no numeric assertion)",
    "test_fsdp_pretrain_save_resume": "5 iterations, fsdp_dtensor save, load into a fresh model: the forward-only "
                                      "loss after loading equals the one before (torch.testing.assert_close)",
    "test_fsdp_precision_aware_optimizer_decoupled_grad_consistency":
        "1 iteration with use_precision_aware_optimizer: decoupled grads on in Megatron-FSDP's buffer and in "
        "FusedAdam, clip_grad_norm finite (value not printed)",
}


def harness_failure(r: dict, job: dict | None) -> str | None:
    text = f"{r.get('log_tail') or ''}{r.get('traceback_tail') or ''}{r.get('error') or ''}"
    for sig, why in HARNESS.items():
        if sig in text:
            return why
    return None


def read_logs(work: Path) -> dict:
    """Per-test durations (JUnit, rank 0), gemm_patch lines and Bridge's iteration lines per test."""
    out: dict = {}
    for run in ("tests_patched", "tests_unpatched"):
        d: dict = {}
        xml = work / f"{run}.junit.rank0.xml"
        if xml.is_file() and xml.stat().st_size:
            root = ET.parse(xml).getroot()
            d["time_s"] = {tc.get("name"): float(tc.get("time")) for tc in root.iter("testcase")}
            suite = next(root.iter("testsuite"), None)
            if suite is not None:
                d["session_s"] = float(suite.get("time"))
        log = (work / f"{run}.log").read_text(errors="replace") if (work / f"{run}.log").is_file() else ""
        d["gemm_patch_lines"] = rb.gemm_patch_lines(work / f"{run}.log")
        desel = re.findall(r"=+ .*?(\d+) deselected.* =+$", log, re.M)
        if desel:
            d["deselected"] = int(desel[0])  # by -m 'not pleasefixme' (run_bridge.py)
        test, iters = None, {}
        for line in log.split("=== short test summary")[0].splitlines():
            m = re.search(r"::(test_\w+)", line)
            if m:
                test = m.group(1)
            m = re.search(r"iteration\s+(\d+)/\s*(\d+) .*?elapsed time per iteration \(ms\): ([\d.]+).*?"
                          r"lm loss: ([\d.E+-]+).*?grad norm: ([\d.]+)", line)
            if m and test:
                iters.setdefault(test, []).append({
                    "iteration": int(m.group(1)), "of": int(m.group(2)), "ms_per_iter": float(m.group(3)),
                    "lm_loss": float(m.group(4)), "grad_norm": float(m.group(5))})
        if iters:
            d["iteration_lines"] = iters
        out[run] = d
    return out


def recover(r: dict, work: Path, tgz: str) -> dict:
    """A driver that stopped before reading wave 1: its run records, losses, unpatched outcome and
    Bridge's tests rebuilt from the logs tgz (run_bridge.postprocess); gradient parity and
    patched_timing stay null with the reason (the grads.pt dumps are not in the tgz)."""
    r = {**r, "notes": list(r.get("notes") or [])}
    runs = rb.postprocess(r, work, tests=bool(r.get("bridge_tests_source")), parity=False)
    fn = (re.findall(r'run_bridge\.py", line \d+, in (\w+)', r.get("driver_traceback") or "") or ["?"])[-1]
    exc = r["driver_error"].split(":")[0]
    why = "; ".join(f"{n}: {note}" for n, x in runs.items() for note in x.get("result_file_notes") or [])
    log = (work / "unpatched.log").read_text(errors="replace") if (work / "unpatched.log").is_file() else ""
    codes = re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*: (-?\d+)", log)
    exits = ", ".join(f"rank {k} exit code {c}" + (" (SIGTERM)" if c == "-15" else "") for k, c in sorted(set(codes)))
    dumps = [n for n, x in runs.items() if (x.get("dump") or {}).get("path")]
    fixed = DRIVER_FIXED.get((exc, fn))
    stop = f"run_bridge.py's driver stopped ({r['driver_error']}, in {fn}()) after wave 1"
    r["grad_parity_not_measured"] = (
        f"not measured: {stop}, before gradient parity and the patched_timing run"
        + (f": {why}" if why else "") + (f" (torchrun on unpatched: {exits})" if exits else "")
        + f". The step-1 gradient dumps (grads.pt of {', '.join(dumps) or 'no run'}) stayed in /tmp/br on the "
        f"device machine and are not in {tgz}, so parity cannot be recomputed from these files."
        + (f" Harness fixed since: {fixed}." if fixed else ""))
    if "patched" in r:
        r["patched"]["median_step_ms"] = None
        r["patched"]["median_step_ms_not_measured"] = (
            f"no patched_timing run ({stop}); median_step_ms_concurrent is wave 1's, patched concurrent "
            "with 5 other jobs on the same 2 GPUs")
    r["recovered_from"] = f"{tgz} (run_bridge.postprocess on its logs and result files; the driver JSON has none)"
    return r


def tests_block(bt: dict, logs: dict) -> dict:
    def one(b: dict, extra: dict) -> dict:
        return {"passed": b.get("passed"), "failed": b.get("failed"), "skipped": b.get("skipped"),
                "errors": b.get("errors"),
                "tests": {n: {"outcome": o, "time_s": (extra.get("time_s") or b.get("time_s") or {}).get(n)}
                          for n, o in (b.get("tests") or {}).items()},
                **{k: extra[k] for k in ("session_s", "deselected") if k in extra},
                **({"messages": b["messages"]} if b.get("messages") else {})}

    pt, ut = logs.get("tests_patched", {}), logs.get("tests_unpatched", {})
    block = one(bt, pt)
    block["gemm_patch_lines"] = pt.get("gemm_patch_lines") or bt.get("gemm_patch_lines") or []
    if pt.get("iteration_lines"):
        block["iteration_lines"] = pt["iteration_lines"]
    block["unpatched"] = one(bt.get("unpatched") or {}, ut)
    return block


def pairing(r: dict, logs: dict, fixed_in: str | None, work: Path | None = None) -> dict:
    jobs = r.get("jobs") or {}
    why = {n: harness_failure(r.get(n) or {}, jobs.get(n)) for n in RUNS if n in r}
    fix = f"; fixed in {fixed_in}" if fixed_in else ""
    bt = tests_block(r.get("bridge_tests") or {}, logs) if r.get("bridge_tests") else None
    p, u = r.get("patched") or {}, r.get("unpatched") or {}
    out: dict = {"bridge_version": r.get("bridge_version"), "megatron_core": r.get("megatron_core"),
                 "transformer_engine": r.get("transformer_engine"), "torch": r.get("torch"), "gpus": r.get("gpus")}

    if why.get("unpatched") and bt:
        ut = bt["unpatched"]
        msgs = ut.get("messages") or {}
        first = next(iter(msgs.values()), "")
        same = [n for n, m in msgs.items() if m == first]
        rest = {n: m for n, m in msgs.items() if m != first}
        out["unpatched_outcome"] = (
            f"Bridge {r.get('bridge_version')}'s own Megatron-FSDP functional tests with fusion on and fp32 "
            f"main grads, unpatched ({ut['failed']} of {ut['failed'] + ut['passed']} failed): {', '.join(same)} "
            f"fail while building the model with \"{first}\""
            + "".join(f"; {n} then fails with \"{m}\" (state left behind by the failed tests before it, "
                      "not a separate finding)" for n, m in rest.items())
            + f". Bridge's pretraining entry point unpatched: not run ({why['unpatched']}{fix}).")
        out["unpatched_outcome_source"] = "bridge_tests.unpatched (the pretraining job did not run)"
    elif u and u.get("ok") is False:
        steps = f"after {u['steps']} steps" if u.get("steps") else "before its first step"
        ut = (bt or {}).get("unpatched") or {}
        tests = (f" Bridge's own Megatron-FSDP tests unpatched: {ut.get('passed')} passed, {ut.get('failed')} failed."
                 if ut else "")
        out["unpatched_outcome"] = (
            f"Bridge {r.get('bridge_version')}'s pretrain() unpatched (fusion at Bridge's default: on) failed {steps} "
            f"with megatron-core's {rb.failed_outcome(u, (work or Path('/nonexistent')) / 'unpatched.log')}.{tests}")
        out["unpatched_outcome_source"] = "unpatched.error and its traceback (the rank's result file)"
    else:
        out["unpatched_outcome"] = r.get("unpatched_outcome")

    if why.get("patched"):
        out["patched"] = {"losses": None, "median_step_ms": None, "not_run": why["patched"] + fix}
    else:
        out["patched"] = {"losses": p.get("losses"), "median_step_ms": p.get("median_step_ms"),
                          **{k: p[k] for k in ("median_step_ms_source", "median_step_ms_not_measured",
                                               "median_step_ms_concurrent", "loss_max_abs_diff_vs_off", "steps",
                                               "ok", "error", "fusion_in_model", "gemm_patch_lines",
                                               "gemm_patch_status") if k in p}}
    for n in ("off", "off_repeat"):  # fusion off, unpatched: the reference and its run-to-run noise
        if r.get(n):
            out[n] = {k: r[n][k] for k in ("losses", "median_step_ms_concurrent", "loss_max_abs_diff_off_repeat",
                                           "fusion_in_model", "ok", "error") if k in r[n]}
    gp = r.get("grad_parity")
    if gp:
        out["grad_parity"] = gp
    else:
        blocked = [n for n in ("patched", "off") if why.get(n)]
        err = (r.get("stage_errors") or {}).get("grad parity patched")
        reason = r.get("grad_parity_not_measured") or (
            f"not measured: {', '.join(blocked)} did not run ({why[blocked[0]]}{fix})" if blocked
            else f"not measured: run_bridge.py's parity stage raised {err}" if err
            else "not measured: a run it needs failed (see pairings)")
        out["grad_parity"] = {"params": None, "max_rel_diff": None, "passed": None, "not_measured": reason}
    if bt:
        bt["what_they_check"] = {n: CHECKS[n] for n in bt["tests"] if n in CHECKS}
        out["bridge_tests"] = bt
        out["bridge_tests_source"] = r.get("bridge_tests_source")
    out["notes"] = r.get("notes")
    for k in ("recovered_from", "driver_error", "stage_errors"):
        if r.get(k):
            out[k] = r[k]
    return out


def trimmed(r: dict) -> dict:
    r = json.loads(json.dumps(r))
    for n in RUNS:
        for k in ("log_tail", "traceback_tail"):
            if isinstance(r.get(n), dict) and r[n].get(k):
                r[n][k] = "\n".join(r[n][k].splitlines()[:4])[:400]
    if r.get("driver_traceback"):
        lines = r["driver_traceback"].splitlines()
        r["driver_traceback"] = "\n".join([x.strip() for x in lines if 'run_bridge.py"' in x] + lines[-1:])
    return r


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--source", required=True, help="where the files came from (machine, date)")
    ap.add_argument("--fixed-in", help="commit that fixed a harness failure seen in these files")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--keep", help="an earlier bridge.json: its pairings that these files do not replace stay")
    a = ap.parse_args(argv)
    runs, pairs = [json.loads(Path(p).read_text()) for p in a.files], []
    for path, r in zip(a.files, runs, strict=True):
        tgz = Path(path).with_name(Path(path).name.replace("bridge_", "logs_").replace(".json", ".tgz"))
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            if tgz.exists():
                with tarfile.open(tgz) as t:
                    t.extractall(work, filter="data")
            if tgz.exists() and r.get("driver_error") and not any(n in r for n in RUNS):
                r = recover(r, work, tgz.name)
            pairs.append(pairing(r, read_logs(work) if tgz.exists() else {}, a.fixed_in, work))
    every = {f"bridge {p['bridge_version']} + megatron-core {p['megatron_core']}": {**p, "from": a.source,
                                                                                 "raw": trimmed(r)}
             for p, r in zip(pairs, runs, strict=True)}
    old = json.loads(Path(a.keep).read_text()) if a.keep else {"pairings": {}}
    kept = [k for k in old["pairings"] if k not in every]  # after the new ones: a new file replaces its pairing
    every.update({k: {**old["pairings"][k], "from": old["pairings"][k].get("from") or old["source"]["from"]}
                  for k in kept})
    top_key = next((k for k, v in every.items() if v["grad_parity"].get("passed") is not None), next(iter(every)))
    merged = {**{k: v for k, v in every[top_key].items() if k != "raw"},
              "source": {"files": [str(Path(p).name) for p in a.files], "from": a.source,
                         **({"kept": f"{', '.join(kept) or 'nothing'} from {a.keep}"} if a.keep else {}),
                         "top_level": f"{top_key} (the first pairing with a measured gradient parity); every "
                                      "pairing under pairings, each with where it was measured (from)",
                         "how": "validation/frameworks/bridge/run_bridge.py on 2 x H200 (TE from the GPU kit); "
                                "see validation/frameworks/bridge/README.md"},
              "pairings": every}
    Path(a.out).write_text(json.dumps(merged, indent=1, default=str) + "\n")
    for p in pairs:
        gp, bt, pt = p["grad_parity"], p.get("bridge_tests") or {}, p["patched"]
        u = bt.get("unpatched") or {}
        print(f"{p['bridge_version']} + {p['megatron_core']}: unpatched: {str(p['unpatched_outcome'])[:200]}")
        print(f"  patched losses {pt.get('losses')} median {pt.get('median_step_ms')} ms "
              f"(concurrent {pt.get('median_step_ms_concurrent')}) {pt.get('not_run', '')[:80]}")
        print(f"  grad parity {gp.get('passed')} ({gp.get('params')} params, max rel {gp.get('max_rel_diff')})")
        print(f"  tests patched {bt.get('passed')}/{bt.get('failed')}/{bt.get('skipped')} "
              f"unpatched {u.get('passed')}/{u.get('failed')}/{u.get('skipped')} (passed/failed/skipped)")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
