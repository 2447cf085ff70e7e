"""``gemm-patch compare -- COMMAND ...``: run the user's own training command twice, fusion on
under gemm-patch and fusion off, one after the other, and judge the two by megatron's own log.

The fusion-on run gets ``gemm-patch run`` semantics (the launcher's environment: every Python
process the command starts, torchrun workers included, is patched). The fusion-off run is the
reference, megatron as shipped: the command with ``--no-gradient-accumulation-fusion`` appended
(``--off-arg`` replaces it, e.g. ``model.gradient_accumulation_fusion=false`` for a
Megatron-Bridge or NeMo override) and ``GEMM_PATCH=0``, which turns gemm-patch off even where
the script imports it or ``GEMM_PATCH_AUTO=1`` is set (``--off-patched`` keeps it on there).
``--iters N`` appends ``--train-iters N`` to both (argparse keeps the last occurrence of a flag,
so it overrides the command's own; ``--iters-arg 'train.train_iters={n}'`` for other styles).

What is read: megatron's ``training_log`` line (printed on the last rank at iteration 1 and
every ``--log-interval``; the loss is the mean over the interval, the time per iteration the
interval's mean)::

     [...] iteration       10/      20 | consumed samples: ... | elapsed time per iteration (ms): 775.3 | ...
       lm loss: 4.276149E+00 | loss scale: 1.0 | grad norm: 0.717 | ...

and its memory report (after iteration 1 and the next logged one; every ``--log-memory-interval``)::

    [Rank 0] (after 10 iterations) memory (MB) | allocated: 323.11 | max allocated: 679.93 | reserved: ...

The same in megatron-core 0.17.1 and 0.19.2 and in Megatron-Bridge's log.

The verdict (the defaults, ``--loss-rtol``, ``--grad-norm-rtol``, ``--judge-until``): at every
iteration up to 20 that both runs logged, ``|on - off| <= rtol * |off|`` for the lm loss (1e-3)
and the grad norm (1e-2; plus 0.001, the grad norm is printed with 3 decimals). Why: iteration 1
starts from the same weights and batch, so the forward and the loss are the same; the two runs'
gradients differ only in how each weight gradient is accumulated (fused: in fp32; fusion off:
rounded to bf16 per micro-batch, a relative error of at most 2^-8 per element, about 2^-9 in
norm), so the grad norm agrees to about 0.002; 1e-2 is above that and above the slow drift of
two correct runs over their first updates, and far below what a lost gradient does. Measured on
Megatron-LM's pretrain_gpt.py (validation/convergence, hidden 512, 4 micro-batches): patched vs
fusion off, grad norm equal to 3 decimals at iteration 1, 2.5e-3 apart at 20, lm loss 1.2e-5;
with gemm-patch's correctness fixes off (upstream's fused behaviour) the grad norm is 0.63 apart at
iteration 1 and the loss 2.2e-3 at 10. Later iterations are printed but not judged: two correct
runs drift apart (there 2.2e-2 in grad norm at 30, 0.45 at isolated spikes by 70).

Exit status: 0 same, 1 differs (or exactly one run failed), 2 usage, a log it cannot read, or
both runs failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .launcher import launch_env

EXIT_SAME, EXIT_DIFFERS, EXIT_UNREADABLE = 0, 1, 2
DEFAULT_OFF_ARGS = ("--no-gradient-accumulation-fusion",)
DEFAULT_ITERS_ARG = "--train-iters {n}"
LOSS_RTOL, GRAD_NORM_RTOL, JUDGE_UNTIL = 1e-3, 1e-2, 20
GRAD_NORM_PRINTED = 1e-3  # megatron prints the grad norm with 3 decimals
TAIL_LINES = 20

ITERATION_RE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
MEMORY_RE = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| "
                       r"max allocated: ([\d.]+) \| reserved: ([\d.]+) \| max reserved: ([\d.]+)")
GEMM_PATCH_LINE_RE = re.compile(r"\[gemm_patch\] (?:INFO|WARNING|ERROR): .*")
LOOKED_FOR = ("megatron's training log line ' iteration N/ M | ... elapsed time per iteration (ms): X | ... "
              "lm loss: X | ... grad norm: X |' (printed on the last rank at iteration 1 and every --log-interval)")


@dataclass
class Iteration:
    iteration: int
    of: int
    loss: float | None
    grad_norm: float | None
    step_ms: float | None


@dataclass
class MemoryReport:
    rank: int
    after: int
    allocated_mb: float
    max_allocated_mb: float
    reserved_mb: float
    max_reserved_mb: float


@dataclass
class Log:
    iterations: list[Iteration] = field(default_factory=list)
    memory: list[MemoryReport] = field(default_factory=list)
    gemm_patch_lines: list[str] = field(default_factory=list)

    def last_memory(self) -> MemoryReport | None:
        """The latest report of the lowest rank that printed one."""
        if not self.memory:
            return None
        rank = min(m.rank for m in self.memory)
        return max((m for m in self.memory if m.rank == rank), key=lambda m: m.after)

    def step_ms(self) -> float | None:
        """Median of the logged per-iteration times after the first line (iteration 1 holds start-up)."""
        times = [it.step_ms for it in self.iterations[1:] if it.step_ms is not None]
        return statistics.median(times) if times else None


def _number(fields: Mapping[str, str], key: str) -> float | None:
    try:
        return float(fields[key])
    except (KeyError, ValueError):
        return None


def parse_log(text: str) -> Log:
    """The iteration lines, memory reports and gemm-patch's own log lines of one run's output.
    An iteration logged twice (a restarted rank) keeps its first line."""
    log, seen = Log(), set()
    for line in text.splitlines():
        m = ITERATION_RE.search(line)
        if m and int(m.group(1)) not in seen:
            fields = dict(part.strip().split(": ", 1) for part in m.group(3).split("|") if ": " in part)
            seen.add(int(m.group(1)))
            log.iterations.append(Iteration(int(m.group(1)), int(m.group(2)), _number(fields, "lm loss"),
                                            _number(fields, "grad norm"),
                                            _number(fields, "elapsed time per iteration (ms)")))
            continue
        m = MEMORY_RE.search(line)
        if m:
            log.memory.append(MemoryReport(int(m.group(1)), int(m.group(2)), *map(float, m.groups()[2:])))
            continue
        m = GEMM_PATCH_LINE_RE.search(line)
        if m and m.group(0) not in log.gemm_patch_lines:
            log.gemm_patch_lines.append(m.group(0))
    return log


@dataclass
class Run:
    key: str  # "on" or "off"
    label: str
    command: list[str]
    env_changes: dict[str, str]
    shown_as: str  # how the command line is shown: what the environment change amounts to
    log_path: str
    rc: int = 0
    seconds: float = 0.0
    log: Log = field(default_factory=Log)
    tail: list[str] = field(default_factory=list)

    def shown(self) -> str:
        return f"{self.shown_as}{shlex.join(self.command)}"

    def problem(self) -> str | None:
        if self.rc != 0:
            return f"the {self.label} run failed: exit code {self.rc}"
        if not self.log.iterations:
            return f"cannot read the {self.label} run's log: no megatron iteration line in it"
        if all(it.loss is None for it in self.log.iterations):
            return f"the {self.label} run's iteration lines carry no 'lm loss: X |' field"
        return None


def execute(run: Run, env: Mapping[str, str], progress: TextIO) -> Run:
    """Run the command, its output (stdout and stderr) into the log file; one progress line per
    logged iteration."""
    start = time.monotonic()
    with open(run.log_path, "w", encoding="utf-8", errors="replace") as out:
        try:
            proc = subprocess.Popen(run.command, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1)
        except FileNotFoundError:
            out.write(f"{run.command[0]}: command not found\n")
            run.rc = 127
        except OSError as exc:
            out.write(f"{run.command[0]}: {exc.strerror or exc}\n")
            run.rc = 126
        else:
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    out.write(line)
                    m = ITERATION_RE.search(line)
                    if m:
                        print(f"  {run.label}: iteration {m.group(1)}/{m.group(2)} "
                              f"({time.monotonic() - start:.0f} s)", file=progress, flush=True)
            except KeyboardInterrupt:  # let the command, which got the signal too, end first
                proc.wait()
                raise
            run.rc = proc.wait()
    run.seconds = round(time.monotonic() - start, 1)
    text = Path(run.log_path).read_text(encoding="utf-8", errors="replace")
    run.log, run.tail = parse_log(text), text.splitlines()[-TAIL_LINES:]
    return run


def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return abs(a - b) / abs(b) if b else (0.0 if a == b else float("inf"))


def judge(on: Log, off: Log, loss_rtol: float, grad_norm_rtol: float, judge_until: int) -> dict[str, Any]:
    """Rows per iteration either run logged, the first difference among those judged, or None."""
    a, b = ({it.iteration: it for it in log.iterations} for log in (on, off))
    rows, first = [], None
    for n in sorted(set(a) | set(b)):
        x, y = a.get(n), b.get(n)
        row: dict[str, Any] = {"iteration": n, "judged": n <= judge_until}
        for name in ("loss", "grad_norm", "step_ms"):
            row[name] = [getattr(x, name) if x else None, getattr(y, name) if y else None]
        row["loss_rel"], row["grad_norm_rel"] = _rel(*row["loss"]), _rel(*row["grad_norm"])
        reason = None
        if x is None or y is None:
            reason = f"logged by the fusion-{'on' if x else 'off'} run only"
        elif (x.loss is None) != (y.loss is None):
            reason = "lm loss logged by one run only"
        elif row["loss_rel"] is not None and row["loss_rel"] > loss_rtol:
            reason = f"lm loss {x.loss:.6E} vs {y.loss:.6E}, relative difference {row['loss_rel']:.2e} > {loss_rtol:g}"
        elif (x.grad_norm is not None and y.grad_norm is not None
              and abs(x.grad_norm - y.grad_norm) > grad_norm_rtol * abs(y.grad_norm) + GRAD_NORM_PRINTED):
            reason = (f"grad norm {x.grad_norm:.3f} vs {y.grad_norm:.3f}, relative difference "
                      f"{row['grad_norm_rel']:.2e} > {grad_norm_rtol:g}")
        row["differs"] = reason
        if reason and row["judged"] and first is None:
            first = {"iteration": n, "why": reason}
        rows.append(row)
    return {"rows": rows, "first_difference": first,
            "judged_iterations": [r["iteration"] for r in rows if r["judged"]]}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(runs: Sequence[Run], result: dict[str, Any], out: TextIO) -> None:
    on, off = runs
    for run in runs:
        print(f"{run.label}: {run.shown()}\n  exit code {run.rc}, {run.seconds:.1f} s, log {run.log_path}", file=out)
    for line in on.log.gemm_patch_lines[:6]:
        print(f"  {line}", file=out)
    if not on.log.gemm_patch_lines and not on.problem():
        print("  (no [gemm_patch] line in the fusion-on log: is the log level above INFO?)", file=out)
    comparison = result.get("comparison")
    if comparison:
        print(f"\n{'iteration':>9} | {'lm loss on':>12} | {'lm loss off':>12} | {'rel':>8} | {'grad norm on':>12} | "
              f"{'grad norm off':>13} | {'rel':>8} | {'ms on':>8} | {'ms off':>8} |", file=out)
        for r in comparison["rows"]:
            note = f"differs: {r['differs']}" if r["differs"] else ("" if r["judged"] else "not judged")
            print(f"{r['iteration']:>9} | {_fmt(r['loss'][0], '12.6E')} | {_fmt(r['loss'][1], '12.6E')} | "
                  f"{_fmt(r['loss_rel'], '8.1e')} | {_fmt(r['grad_norm'][0], '12.3f')} | "
                  f"{_fmt(r['grad_norm'][1], '13.3f')} | {_fmt(r['grad_norm_rel'], '8.1e')} | "
                  f"{_fmt(r['step_ms'][0], '8.1f')} | {_fmt(r['step_ms'][1], '8.1f')} | {note}".rstrip(), file=out)
        ms_on, ms_off = on.log.step_ms(), off.log.step_ms()
        ratio = f", on / off {ms_on / ms_off:.3f}" if ms_on and ms_off else ""
        print(f"\nstep time (median of the logged intervals after the first): on {_fmt(ms_on, '.1f')} ms, "
              f"off {_fmt(ms_off, '.1f')} ms{ratio}", file=out)
        mem = [run.log.last_memory() for run in runs]
        if any(mem):
            print("memory (megatron's report, MB) | after | allocated | max allocated | reserved | max reserved",
                  file=out)
            for run, m in zip(runs, mem, strict=True):
                if m:
                    print(f"  {run.label:<28} | {m.after:>5} | {m.allocated_mb:9.1f} | {m.max_allocated_mb:13.1f} | "
                          f"{m.reserved_mb:8.1f} | {m.max_reserved_mb:12.1f}", file=out)
            if all(mem):
                d = [x - y for x, y in zip(*(astuple_mb(m) for m in mem), strict=True)]
                print(f"  {'on - off':<28} | {'':>5} | {d[0]:+9.1f} | {d[1]:+13.1f} | {d[2]:+8.1f} | {d[3]:+12.1f}",
                      file=out)
    print(f"\nverdict: {result['summary']}", file=out)


def astuple_mb(m: MemoryReport) -> tuple[float, float, float, float]:
    return m.allocated_mb, m.max_allocated_mb, m.reserved_mb, m.max_reserved_mb


def decide(runs: Sequence[Run], args: argparse.Namespace) -> dict[str, Any]:
    """The verdict and exit code. A failed run is a difference when the other run succeeded (the
    two behave differently), unreadable when both failed (nothing to compare against)."""
    problems = [p for p in (run.problem() for run in runs) if p]
    comparison = None
    if all(run.log.iterations for run in runs):  # also after a failure late in a run: show what both logged
        comparison = judge(runs[0].log, runs[1].log, args.loss_rtol, args.grad_norm_rtol, args.judge_until)
    failed = [run for run in runs if run.rc != 0]
    if failed:
        both = len(failed) == 2 or any(run.problem() for run in runs if run.rc == 0)
        return {"verdict": "failed", "exit_code": EXIT_UNREADABLE if both else EXIT_DIFFERS,
                "comparison": comparison, "summary": "; ".join(problems)}
    if problems or comparison is None:
        return {"verdict": "unreadable", "exit_code": EXIT_UNREADABLE, "summary": "; ".join(problems)}
    rule = (f"lm loss within {args.loss_rtol:g} and grad norm within {args.grad_norm_rtol:g} (relative; "
            f"+{GRAD_NORM_PRINTED:g} for the printed grad norm) at the iterations both logged up to "
            f"{args.judge_until}")
    judged = comparison["judged_iterations"]
    if not judged:
        return {"verdict": "unreadable", "exit_code": EXIT_UNREADABLE, "comparison": comparison,
                "summary": f"no logged iteration up to {args.judge_until} (--judge-until) to judge"}
    first = comparison["first_difference"]
    if first:
        return {"verdict": "differs", "exit_code": EXIT_DIFFERS, "comparison": comparison, "rule": rule,
                "summary": f"differs at iteration {first['iteration']}: {first['why']}"}
    later = len(comparison["rows"]) - len(judged)
    return {"verdict": "same", "exit_code": EXIT_SAME, "comparison": comparison, "rule": rule,
            "summary": f"same: {rule} (iterations {', '.join(map(str, judged))})"
                       + (f"; {later} later iteration{'s' if later != 1 else ''} shown, not judged" if later else "")}


def as_record(command: list[str], runs: Sequence[Run], result: dict[str, Any],
              args: argparse.Namespace) -> dict[str, Any]:
    """What --json prints (schema 1)."""
    comparison = result.get("comparison") or {}
    return {
        "schema": 1, "command": command, "verdict": result["verdict"], "exit_code": result["exit_code"],
        "summary": result["summary"], "first_difference": comparison.get("first_difference"),
        "tolerance": {"loss_rtol": args.loss_rtol, "grad_norm_rtol": args.grad_norm_rtol,
                      "grad_norm_printed": GRAD_NORM_PRINTED, "judge_until": args.judge_until},
        "rows": comparison.get("rows", []),
        "runs": {run.key: {"label": run.label, "command": run.command, "env": run.env_changes, "rc": run.rc,
                           "seconds": run.seconds, "log": run.log_path, "step_ms": run.log.step_ms(),
                           "iterations": [asdict(i) for i in run.log.iterations],
                           "memory": [asdict(m) for m in run.log.memory],
                           "gemm_patch_lines": run.log.gemm_patch_lines,
                           "tail": run.tail if run.problem() else []} for run in runs},
    }


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--iters", type=int, metavar="N", help="cut both runs to N iterations (appends --iters-arg)")
    parser.add_argument("--iters-arg", default=DEFAULT_ITERS_ARG, metavar="TEMPLATE",
                        help=f"what --iters appends, {{n}} for N (default: '{DEFAULT_ITERS_ARG}'; "
                             "Megatron-Bridge: 'train.train_iters={n}')")
    parser.add_argument("--off-arg", action="append", metavar="ARG",
                        help="what turns fusion off, appended to the fusion-off run (repeatable; default: "
                             "--off-arg=--no-gradient-accumulation-fusion; Bridge/NeMo: "
                             "model.gradient_accumulation_fusion=false)")
    parser.add_argument("--off-patched", action="store_true",
                        help="run the fusion-off run under gemm-patch too (default: GEMM_PATCH=0, megatron as shipped)")
    parser.add_argument("--loss-rtol", type=float, default=LOSS_RTOL, help=f"default {LOSS_RTOL:g}")
    parser.add_argument("--grad-norm-rtol", type=float, default=GRAD_NORM_RTOL, help=f"default {GRAD_NORM_RTOL:g}")
    parser.add_argument("--judge-until", type=int, default=JUDGE_UNTIL, metavar="N",
                        help=f"judge the iterations up to N (default {JUDGE_UNTIL}); later ones are shown only")
    parser.add_argument("--logs", metavar="DIR", help="where the two runs' logs go (default: a new temporary folder)")
    parser.add_argument("--json", nargs="?", const="-", metavar="FILE",
                        help="a JSON record (schema 1): printed instead of the table, or with FILE written there "
                             "beside the table")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="the training command and its arguments")
    return parser


def main(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command[:1] == ["--"]:
        command = command[1:]
    usage = None
    if not command:
        usage = "no command given: gemm-patch compare [OPTIONS] -- COMMAND [ARGS ...]"
    elif args.iters is not None and args.iters < 1:
        usage = f"--iters must be a positive number of iterations, not {args.iters}"
    elif args.iters is not None and "{n}" not in args.iters_arg:
        usage = f"--iters-arg must contain {{n}} (where N goes), got {args.iters_arg!r}"
    if usage:
        print(f"gemm-patch compare: {usage}", file=sys.stderr)
        return EXIT_UNREADABLE
    iters_args = [part.replace("{n}", str(args.iters)) for part in shlex.split(args.iters_arg)] \
        if args.iters is not None else []
    off_args = list(args.off_arg) if args.off_arg else list(DEFAULT_OFF_ARGS)
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="gemm-patch-compare-"))
    logs.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "PYTHONUNBUFFERED": "1"}
    patched = launch_env(base)
    on_changes = {k: patched[k] for k in ("PYTHONPATH", "GEMM_PATCH_AUTO")}
    if args.off_patched:
        off_env, off_changes, off_shown = patched, on_changes, "gemm-patch run -- "
    else:
        off_env, off_changes, off_shown = {**base, "GEMM_PATCH": "0"}, {"GEMM_PATCH": "0"}, "GEMM_PATCH=0 "
    runs = [Run("on", "fusion on (gemm-patch)", command + iters_args, on_changes, "gemm-patch run -- ",
                str(logs / "fusion_on.log")),
            Run("off", "fusion off", command + iters_args + off_args, off_changes, off_shown,
                str(logs / "fusion_off.log"))]
    for run, env in zip(runs, (patched, off_env), strict=True):
        print(f"gemm-patch compare: {run.label}: {run.shown()}", file=sys.stderr, flush=True)
        try:
            execute(run, env, sys.stderr)
        except KeyboardInterrupt:  # the command, in the same process group, got the signal too
            print(f"gemm-patch compare: interrupted during the {run.label} run (log {run.log_path})", file=sys.stderr)
            return 130
    result = decide(runs, args)
    if args.json and args.json != "-":
        Path(args.json).write_text(json.dumps(as_record(command, runs, result, args), indent=1) + "\n")
    if args.json == "-":
        print(json.dumps(as_record(command, runs, result, args), indent=1))
    else:
        render(runs, result, sys.stdout)
    for run in runs:
        if run.problem():
            sys.stdout.flush()
            looked_for = f" (looked for {LOOKED_FOR})" if run.rc == 0 else ""
            print(f"gemm-patch compare: {run.problem()}{looked_for}; last lines of its output ({run.log_path}):",
                  file=sys.stderr)
            for line in run.tail:
                print(f"  | {line}", file=sys.stderr)
    return result["exit_code"]
