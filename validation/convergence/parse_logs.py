"""Parse pretrain_gpt.py logs written by run.sh into result records.

    python -m validation.convergence.parse_logs --release 0.17.1 --mode convergence --logs DIR --out FILE
    python -m validation.convergence.parse_logs --release 0.19.2 --mode seeds --log DIR/patched_s1236.log --out FILE
    python -m validation.convergence.parse_logs --merge FILE... --out validation/convergence/results.json
    python -m validation.convergence.parse_logs --pairs FILE...     # same-seed pairs, patched - fusion off

One record per log: release, strategy, mode, run (the log's name), config (patched / fusion_off /
correctness_off / unpatched / dry; MoE runs take the same names, speed runs speed_patched /
speed_fusion_off / speed_bf16_grads), seed, iterations (last logged training iteration), train_loss and
val_loss (iteration -> loss; val_loss keeps the in-loop evaluation, final_val_loss is the last
evaluation printed, the one pretrain runs after training), step_ms (median of the logged
"elapsed time per iteration" over logged intervals after the first), peak_gib (megatron's
"max allocated" memory report), versions, rc, command, and the error line of a failed run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics

TRAIN_RE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([0-9.]+).*?lm loss: ([0-9.Ee+-]+)"
)
VAL_RE = re.compile(r"validation loss at iteration (\d+)(?: on validation set)? \| lm loss value: ([0-9.Ee+-]+)")
MEM_RE = re.compile(r"max allocated: ([0-9.]+)")
EXIT_RE = re.compile(r"^EXIT: rc=(-?\d+) seconds=(\d+)", re.M)
ERROR_RE = re.compile(r"^(?:\[rank\d+\]: )?((?:\w+\.)*\w+(?:Error|Exception): .*)$", re.M)
PATCH_RE = re.compile(r"^\[gemm_patch\] INFO: .*$", re.M)


def config_of(name: str) -> tuple[str, int | None]:
    """(config, seed from the name or None) for run.sh's run names.

    MoE runs (``moe_patched_s1234``, ``moe_dry``) take the plain config name; their records carry
    mode ``moe``. Speed runs keep their prefix (``speed_patched_r2`` -> ``speed_patched``).
    """
    m = re.search(r"_seed(\d+)$|_s(\d+)$", name)
    seed = int(m.group(1) or m.group(2)) if m else None
    base = name[: m.start()] if m else name
    base = re.sub(r"_r\d+$", "", base)
    base = re.sub(r"^moe_", "", base)
    return base, seed


def _first_cause(errors: list[str]) -> str:
    """The first raised error that is not torchrun's ChildFailedError wrapper."""
    causes = [e for e in errors if "ChildFailedError" not in e] or errors
    return causes[0][:400]


def parse_log(text: str) -> dict:
    train, step_ms, val = {}, [], {}
    final_val = None
    for m in TRAIN_RE.finditer(text):
        it = int(m.group(1))
        train[it] = float(m.group(4))
        step_ms.append(float(m.group(3)))
    for m in VAL_RE.finditer(text):
        it, loss = int(m.group(1)), float(m.group(2))
        val.setdefault(it, loss)
        final_val = loss
    mem = [float(x) for x in MEM_RE.findall(text)]
    ex = EXIT_RE.search(text)
    errors = ERROR_RE.findall(text)
    seed = re.search(r"--seed (\d+)", text)
    cmd = re.search(r"^COMMAND: (.*)$", text, re.M)
    return {
        "seed": int(seed.group(1)) if seed else None,
        "iterations": max(train) if train else 0,
        "train_loss": {str(k): train[k] for k in sorted(train)},
        "val_loss": {str(k): val[k] for k in sorted(val)},
        "final_val_loss": final_val,
        "step_ms": statistics.median(step_ms[1:] or step_ms) if step_ms else None,
        "peak_gib": round(max(mem) / 1024, 3) if mem else None,
        "rc": int(ex.group(1)) if ex else None,
        "seconds": int(ex.group(2)) if ex else None,
        "error": _first_cause(errors) if errors and (not ex or ex.group(1) != "0") else None,
        "gemm_patch_lines": PATCH_RE.findall(text)[:4],
        "command": cmd.group(1) if cmd else None,
        "skipped": "skipped" in text[:200] and not train,
    }


def read_versions(logs: str) -> dict:
    vpath = os.path.join(logs, "versions.json")
    if not os.path.exists(vpath):
        return {}
    with open(vpath) as f:
        text = f.read()
    try:
        return json.loads(text)
    except ValueError:  # the versions step failed (run.sh hides its errors): keep what it printed
        return {"unreadable": text[:400]}


def parse_file(path: str, release: str, mode: str, versions: dict) -> dict:
    """The record of one log; its name (without .log) is the run's."""
    name = os.path.basename(path)[: -len(".log")]
    with open(path, errors="replace") as f:
        rec = parse_log(f.read())
    config, seed = config_of(name)
    rec = {"release": release, "strategy": "optim_grads_params", "mode": mode, "run": name,
           "config": config, **rec, "versions": versions}
    if rec["seed"] is None:
        rec["seed"] = seed
    return rec


def parse_dir(logs: str, release: str, mode: str) -> list[dict]:
    versions = read_versions(logs)
    return [parse_file(os.path.join(logs, fn), release, mode, versions)
            for fn in sorted(os.listdir(logs)) if fn.endswith(".log")]


def pairs(records: list[dict]) -> list[str]:
    """Same-seed pairs: per (release, mode, seed) with a patched and a fusion_off run that both
    reached a final validation loss, patched - fusion off; then how many are positive, their mean
    and the two-sided sign-test probability of at least that lopsided a count were each sign a coin toss."""
    final = {}
    for r in records:
        if r["config"] in ("patched", "fusion_off") and r.get("final_val_loss") is not None and r.get("seed"):
            final[(r["release"], r["mode"], r["seed"], r["config"])] = r["final_val_loss"]
    lines, diffs = [], []
    for (rel, mode, seed, config), loss in sorted(final.items()):
        off = final.get((rel, mode, seed, "fusion_off"))
        if config == "patched" and off is not None:
            diffs.append(loss - off)
            lines.append(f"{rel} {mode} seed {seed}: patched {loss:.4f} fusion off {off:.4f} diff {loss - off:+.4f}")
    if diffs:
        n, pos = len(diffs), sum(d > 0 for d in diffs)
        tail = sum(math.comb(n, k) for k in range(max(pos, n - pos), n + 1)) / 2 ** n
        lines.append(f"{n} pairs: {pos} positive, mean {statistics.mean(diffs):+.4f}, median "
                     f"{statistics.median(diffs):+.4f}, sign test p = {min(1.0, 2 * tail):.3f}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--release")
    ap.add_argument("--mode", default="convergence")
    ap.add_argument("--logs")
    ap.add_argument("--log", help="one log (its folder's versions.json is read): a records file of that run alone")
    ap.add_argument("--merge", nargs="*", help="record files to concatenate")
    ap.add_argument("--pairs", nargs="*", help="record files: print the same-seed pairs (patched - fusion off)")
    ap.add_argument("--data", help="make_data.py's JSON summary to store (without its file list) as 'data'")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.pairs:
        records = []
        for path in a.pairs:
            with open(path) as f:
                records += json.load(f)["runs"]
        print("\n".join(pairs(records)))
        return
    if not a.out:
        ap.error("--out is required")
    if a.merge:
        records = []
        for path in a.merge:
            with open(path) as f:
                records += json.load(f)["runs"]
    elif a.log:
        records = [parse_file(a.log, a.release, a.mode, read_versions(os.path.dirname(a.log)))]
    else:
        records = parse_dir(a.logs, a.release, a.mode)
    result = {"runs": records}
    if a.data:
        with open(a.data) as f:
            result["data"] = {k: v for k, v in json.load(f).items() if k != "files"}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in records:
        print(f"{r['release']} {r['run']:<24} rc={r['rc']} it={r['iterations']} "
              f"final_val={r['final_val_loss']} step_ms={r['step_ms']} peak_gib={r['peak_gib']}"
              + (f" error={r['error']}" if r["error"] else ""))


if __name__ == "__main__":
    main()
