#!/usr/bin/env python
"""Merge run_bridge.py's per-pairing JSONs into examples/results/bridge.json (issue 11's schema).

    python examples/bridge/merge_results.py FILES_AT/bridge_0.6.2.json [FILES_AT/bridge_0.4.2.json] \\
        --source "device call 5, 2 x H200, 2026-11-30" [--fixed-in COMMIT]

Top level: the first file's pairing as issue 11 asks (``bridge_version``, ``megatron_core``,
``unpatched_outcome``, ``patched`` {``losses``, ``median_step_ms``}, ``grad_parity`` {``params``,
``max_rel_diff``, ``passed``}, ``bridge_tests`` {``passed``, ``failed``, ``skipped``, ``unpatched``}),
nulls where nothing was measured, each with its reason. Every file is also kept under
``pairings`` (log tails cut to their last lines). Where ``logs_X.tgz`` lies beside ``bridge_X.json``,
Bridge's test logs and JUnit files are read for per-test durations, gemm_patch's status lines and
the loss lines Bridge's training loop printed.

A pretraining job whose log shows a known harness failure (``HARNESS``) did not test Bridge:
its fields are null with ``not_run``; the unpatched outcome then comes from Bridge's own tests.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "results" / "bridge.json"
HARNESS = {
    "source code cannot contain null bytes": (
        "harness bug: run_bridge.py passed the Python interpreter as torchrun's training script "
        "(torchrun runs its first positional argument with python itself), so the job died in ~5 s "
        "with 'SyntaxError: source code cannot contain null bytes' before importing Bridge"),
}
RUNS = ("unpatched", "patched", "off", "off_repeat")
CHECKS = {  # Bridge's tests/functional_tests/test_groups/megatron_fsdp/test_megatron_fsdp.py (v0.6.0)
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


def read_logs(tgz: Path) -> dict:
    """Per-test durations (JUnit, rank 0), gemm_patch lines and Bridge's iteration lines per test."""
    out: dict = {}
    with tarfile.open(tgz) as t:
        files = {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}
    for run in ("tests_patched", "tests_unpatched"):
        d: dict = {}
        xml = files.get(f"{run}.junit.rank0.xml")
        if xml:
            root = ET.parse(io.BytesIO(xml)).getroot()
            d["time_s"] = {tc.get("name"): float(tc.get("time")) for tc in root.iter("testcase")}
            suite = next(root.iter("testsuite"), None)
            if suite is not None:
                d["session_s"] = float(suite.get("time"))
        log = files.get(f"{run}.log", b"").decode(errors="replace")
        d["gemm_patch_lines"] = sorted(set(re.findall(r"\[gemm_patch\] [A-Z]+:[^\n]{0,300}", log)))
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


def tests_block(bt: dict, logs: dict) -> dict:
    def one(b: dict, extra: dict) -> dict:
        return {"passed": b.get("passed"), "failed": b.get("failed"), "skipped": b.get("skipped"),
                "errors": b.get("errors"),
                "tests": {n: {"outcome": o, "time_s": (extra.get("time_s") or b.get("time_s") or {}).get(n)}
                          for n, o in (b.get("tests") or {}).items()},
                **({"session_s": extra["session_s"]} if "session_s" in extra else {}),
                **({"messages": b["messages"]} if b.get("messages") else {})}

    pt, ut = logs.get("tests_patched", {}), logs.get("tests_unpatched", {})
    block = one(bt, pt)
    block["gemm_patch_lines"] = pt.get("gemm_patch_lines") or bt.get("gemm_patch_lines") or []
    if pt.get("iteration_lines"):
        block["iteration_lines"] = pt["iteration_lines"]
    block["unpatched"] = one(bt.get("unpatched") or {}, ut)
    return block


def pairing(r: dict, logs: dict, fixed_in: str | None) -> dict:
    jobs = r.get("jobs") or {}
    why = {n: harness_failure(r.get(n) or {}, jobs.get(n)) for n in RUNS if n in r}
    fix = f"; fixed in {fixed_in}" if fixed_in else ""
    bt = tests_block(r.get("bridge_tests") or {}, logs) if r.get("bridge_tests") else None
    p = r.get("patched") or {}
    out: dict = {"bridge_version": r.get("bridge_version"), "megatron_core": r.get("megatron_core"),
                 "transformer_engine": r.get("transformer_engine"), "torch": r.get("torch"), "gpus": r.get("gpus")}

    if why.get("unpatched") and bt:
        u = bt["unpatched"]
        msgs = u.get("messages") or {}
        first = next(iter(msgs.values()), "")
        same = [n for n, m in msgs.items() if m == first]
        rest = {n: m for n, m in msgs.items() if m != first}
        out["unpatched_outcome"] = (
            f"Bridge {r.get('bridge_version')}'s own Megatron-FSDP functional tests with fusion on and fp32 "
            f"main grads, unpatched ({u['failed']} of {u['failed'] + u['passed']} failed): {', '.join(same)} "
            f"fail while building the model with \"{first}\""
            + "".join(f"; {n} then fails with \"{m}\" (state left behind by the failed tests before it, "
                      "not a separate finding)" for n, m in rest.items())
            + f". Bridge's pretraining entry point unpatched: not run ({why['unpatched']}{fix}).")
        out["unpatched_outcome_source"] = "bridge_tests.unpatched (the pretraining job did not run)"
    else:
        out["unpatched_outcome"] = r.get("unpatched_outcome")

    if why.get("patched"):
        out["patched"] = {"losses": None, "median_step_ms": None, "not_run": why["patched"] + fix}
    else:
        out["patched"] = {"losses": p.get("losses"), "median_step_ms": p.get("median_step_ms"),
                          **{k: p[k] for k in ("median_step_ms_source", "loss_max_abs_diff_vs_off", "ok", "error",
                                               "fusion_in_model", "gemm_patch_lines") if k in p}}
    gp = r.get("grad_parity")
    if gp:
        out["grad_parity"] = gp
    else:
        blocked = [n for n in ("patched", "off") if why.get(n)]
        reason = (f"not measured: {', '.join(blocked)} did not run ({why[blocked[0]]}{fix})" if blocked
                  else "not measured: a run it needs failed (see pairings)")
        out["grad_parity"] = {"params": None, "max_rel_diff": None, "passed": None, "not_measured": reason}
    if bt:
        bt["what_they_check"] = CHECKS
        out["bridge_tests"] = bt
        out["bridge_tests_source"] = r.get("bridge_tests_source")
    out["notes"] = r.get("notes")
    return out


def trimmed(r: dict) -> dict:
    r = json.loads(json.dumps(r))
    for n in RUNS:
        for k in ("log_tail", "traceback_tail"):
            if isinstance(r.get(n), dict) and r[n].get(k):
                r[n][k] = "\n".join(r[n][k].splitlines()[:4])[:400]
    return r


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--source", required=True, help="where the files came from (device call, machine, date)")
    ap.add_argument("--fixed-in", help="commit that fixed a harness failure seen in these files")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    runs = [json.loads(Path(p).read_text()) for p in a.files]
    pairs = []
    for path, r in zip(a.files, runs, strict=True):
        tgz = Path(path).with_name(Path(path).name.replace("bridge_", "logs_").replace(".json", ".tgz"))
        pairs.append(pairing(r, read_logs(tgz) if tgz.exists() else {}, a.fixed_in))
    merged = {**pairs[0],
              "source": {"files": [str(Path(p).name) for p in a.files], "from": a.source,
                         "how": "examples/bridge/run_bridge.py on 2 x H200 (TE from ../shared/device kit); "
                                "see examples/bridge/README.md"},
              "pairings": {f"bridge {p['bridge_version']} + megatron-core {p['megatron_core']}":
                           {**p, "raw": trimmed(r)} for p, r in zip(pairs, runs, strict=True)}}
    Path(a.out).write_text(json.dumps(merged, indent=1, default=str) + "\n")
    for p in pairs:
        gp, bt, pt = p["grad_parity"], p.get("bridge_tests") or {}, p["patched"]
        u = bt.get("unpatched") or {}
        print(f"{p['bridge_version']} + {p['megatron_core']}: unpatched: {str(p['unpatched_outcome'])[:200]}")
        print(f"  patched losses {pt.get('losses')} median {pt.get('median_step_ms')} ms {pt.get('not_run', '')[:80]}")
        print(f"  grad parity {gp.get('passed')} ({gp.get('params')} params, max rel {gp.get('max_rel_diff')})")
        print(f"  tests patched {bt.get('passed')}/{bt.get('failed')}/{bt.get('skipped')} "
              f"unpatched {u.get('passed')}/{u.get('failed')}/{u.get('skipped')} (passed/failed/skipped)")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
