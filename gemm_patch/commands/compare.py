"""``gemm-patch compare -- COMMAND ...``: run the user's own training command twice, fusion on
under gemm-patch and fusion off, one after the other, and judge the two by megatron's own log and
gemm-patch's read-only gradient probe.

The fusion-on run gets ``gemm-patch run`` semantics (the launcher's environment: every Python
process the command starts, torchrun workers included, is patched). The fusion-off run is the
reference, megatron as shipped: the command with ``--no-gradient-accumulation-fusion`` appended
(``--off-arg`` replaces it, e.g. ``model.gradient_accumulation_fusion=false`` for a
Megatron-Bridge or NeMo override) and ``GEMM_PATCH=0``, which turns every patch off even where the
script imports gemm_patch or ``GEMM_PATCH_AUTO=1`` is set (``--off-patched`` keeps them on there).
``--iters N`` appends ``--train-iters N`` to both (argparse keeps the last occurrence of a flag,
so it overrides the command's own; ``--iters-arg 'train.train_iters={n}'`` for other styles).
Both runs carry ``GEMM_PATCH_GRAD_PROBE`` (gemm_patch/engine/grad_probe.py): each rank records every
parameter's reduced gradient after its process's first two steps, beside the run's log, each record
saying its iteration and process; compare pairs the runs' records by iteration, and says which it
cannot pair (a restarted worker's) as not compared.

Proof first (exit 2 where missing): megatron's argument dump (or, where the log has none, the
probe's reading of the model's configuration) says gradient_accumulation_fusion True in the
fusion-on run and False in the fusion-off run; the fusion-on run shows gemm-patch
applied (its ``[gemm_patch] INFO`` lines or the probe's record) and no ``[gemm_patch] ERROR``.

Then the verdict (docs/using-with.md, "How it judges"):

- iteration 1 starts from the same weights and batch, so the two runs' gradients differ only in
  how each weight gradient is accumulated: each parameter's gradient (the probe's records) within
  max(2^-7, 3 x noise) relative (gemm_patch/commands/compare_params.py), the lm loss within ``--loss-rtol``
  and the grad norm within ``--grad-norm-rtol`` (+0.001: it is printed with 3 decimals);
- iteration 2, where the probe recorded it in both runs: each parameter within max(2^-7, 3 x its
  difference in the reference run), fusion off again with its first-step gradients perturbed by one
  bf16 unit roundoff (``PERTURBATION``): what one step from gradients a rounding apart moves;
- later iterations up to ``--judge-until`` within the strict bounds, or, where they part beyond
  them, within 3 x the drift of the perturbed reference runs from fusion off (``--noise-runs``);
  beyond that, after iterations 1 and 2 agreed (per parameter or by megatron's values alone):
  "drifts" (exit 4, weak evidence), never "differs", which needs what noise cannot give;
- a value compare could not compare (NaN or inf, a step the fp16 loss scaler skipped, an
  iteration one run logged and the other did not) is never "same": the verdict says so (exit 3);
- what the verdict could not judge is said in it: the fixes a reference under gemm-patch
  (``--off-patched``) ran too, read from its own summary lines and probe records; a perturbed
  reference run that failed, and what it would have judged; probe records it cannot pair.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TextIO

from ..engine import grad_probe
from ..engine.target import BYPASSED, PATCHED_STATES
from . import compare_params
from .compare_log import ITERATION_RE, Iteration, Log, MemoryReport, parse_log
from .compare_process import Interrupted, read_text, run_command, signals_end_runs
from .launcher import launch_env

__all__ = ["Iteration", "Log", "MemoryReport", "judge", "main", "parse_log"]

EXIT_SAME, EXIT_DIFFERS, EXIT_UNREADABLE, EXIT_NOT_COMPARED, EXIT_DRIFTS = 0, 1, 2, 3, 4
# The reference runs' first-step gradients, each element times 1 +- this (one bf16 unit roundoff):
# a difference of the size fusion on and off make, so that the reference parts from fusion off as a
# correct fused run does (gemm_patch/engine/grad_probe.py, GEMM_PATCH_GRAD_PROBE_PERTURB).
PERTURBATION = 2.0 ** -8
DEFAULT_OFF_ARGS = ("--no-gradient-accumulation-fusion",)
DEFAULT_ITERS_ARG = "--train-iters {n}"
EVERY_ITERATION_LOGGED = ("--log-interval", "1")
LOSS_RTOL, GRAD_NORM_RTOL, JUDGE_UNTIL = 1e-3, 1e-2, 20
GRAD_NORM_PRINTED = 1e-3  # megatron prints the grad norm with 3 decimals
NOISE_FACTOR = compare_params.NOISE_FACTOR
TAIL_LINES = 20
LOOKED_FOR = ("megatron's training log line ' iteration N/ M | ... elapsed time per iteration (ms): X | ... "
              "lm loss: X | ... grad norm: X |' (printed on the last rank at iteration 1 and every --log-interval)")
FUSION_LINE = "megatron's argument dump line 'gradient_accumulation_fusion ........ True|False'"
UNPATCHED_MARKS = ("cannot import gemm_patch", "runs unpatched")
GEMM_PATCH_OFF_RE = re.compile(r"(?:^|[\s;&|])GEMM_PATCH=['\"]?(?:0|false|no|off)\b", re.IGNORECASE)


@dataclass
class Run:
    key: str  # "on", "off", "noise1", ...
    label: str
    command: list[str]
    env_changes: dict[str, str]
    shown_as: str  # how the command line is shown: what the environment change amounts to
    log_path: str
    rc: int = 0
    seconds: float = 0.0
    log: Log = field(default_factory=Log)
    tail: list[str] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)  # every probe record, as written
    steps: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # iteration -> rank -> record
    unplaced: list[dict[str, Any]] = field(default_factory=list)  # records of no known iteration
    probe: dict[int, dict[str, Any]] = field(default_factory=dict)  # the first step's records, by rank
    probe2: dict[int, dict[str, Any]] = field(default_factory=dict)  # the second step's records

    @property
    def first_step(self) -> int | None:
        """The iteration of the probe's first record (1, or where the run resumed), or None."""
        return min(self.steps, default=None)

    @property
    def probe_dir(self) -> str:
        return self.log_path.removesuffix(".log") + ".grad_probe"

    def shown(self) -> str:
        return f"{self.shown_as}{shlex.join(self.command)}"

    def problem(self) -> str | None:
        if self.rc != 0:
            cause = f": {self.log.exception}" if self.log.exception else ""
            return f"the {self.label} run failed: exit code {self.rc}{cause}"
        if not self.log.iterations:
            return f"cannot read the {self.label} run's log: no megatron iteration line in it"
        if all(it.loss is None for it in self.log.iterations):
            return f"the {self.label} run's iteration lines carry no 'lm loss: X |' field"
        return None


def execute(run: Run, env: Mapping[str, str], progress: TextIO) -> Run:
    """Run the command, its output into the log file; one progress line per logged iteration."""
    start = time.monotonic()

    def on_line(line: str) -> None:
        m = ITERATION_RE.search(line)
        if m:
            print(f"  {run.label}: iteration {m.group(1)}/{m.group(2)} ({time.monotonic() - start:.0f} s)",
                  file=progress, flush=True)

    run.rc = run_command(run.command, env, run.log_path, on_line)
    run.seconds = round(time.monotonic() - start, 1)
    text = read_text(run.log_path)
    run.log, run.tail = parse_log(text), text.splitlines()[-TAIL_LINES:]
    read_probe(run)
    return run


def read_probe(run: Run) -> None:
    """The run's probe records, placed by iteration; its first two steps as ``probe`` and ``probe2``."""
    run.records = grad_probe.read(run.probe_dir)
    run.steps, run.unplaced = grad_probe.by_iteration(run.records)
    first = run.first_step
    run.probe = run.steps.get(first, {}) if first is not None else {}
    run.probe2 = run.steps.get(first + 1, {}) if first is not None else {}


def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return abs(a - b) / abs(b) if b else (0.0 if a == b else math.inf)


def _not_comparable(x: Iteration | None, y: Iteration | None, labels: tuple[str, str]) -> str | None:
    """Why iteration x (fusion on) cannot be compared with y (fusion off), or None."""
    if x is None or y is None:
        return f"logged by the {labels[0] if x else labels[1]} run only"
    for it, label in ((x, labels[0]), (y, labels[1])):
        for name, value in (("lm loss", it.loss), ("grad norm", it.grad_norm)):
            if value is not None and not math.isfinite(value):
                return f"{name} {value} in the {label} run"
        if it.skipped or it.grad_norm is None:
            return (f"a step skipped in the {label} run (fp16 loss scaler: "
                    f"{'no grad norm printed' if it.grad_norm is None else f'{it.skipped} skipped'})")
        if it.loss is None:
            return f"no lm loss in the {label} run"
    return None


def exceeds(value: float, bound: float) -> str:
    """'value > bound', each printed with as many significant digits as it takes for the printed
    numbers to keep that order (3 at least)."""
    for digits in range(3, 18):
        a, b = f"{value:.{digits - 1}e}", f"{bound:.{digits - 1}e}"
        if float(a) > float(b):
            return f"{a} > {b}"
    return f"{value!r} > {bound!r}"


def _beyond(x: Iteration, y: Iteration, loss_bound: float, grad_norm_bound: float) -> str | None:
    loss_rel = _rel(x.loss, y.loss)
    if loss_rel is not None and loss_rel > loss_bound:
        return f"lm loss {x.loss:.6E} vs {y.loss:.6E}, relative difference {exceeds(loss_rel, loss_bound)}"
    if abs(x.grad_norm - y.grad_norm) > grad_norm_bound * abs(y.grad_norm) + GRAD_NORM_PRINTED:
        # The bound as a relative difference: the printed norm's last decimal is allowed for.
        bound = grad_norm_bound + GRAD_NORM_PRINTED / abs(y.grad_norm) if y.grad_norm else math.inf
        return (f"grad norm {x.grad_norm:.3f} vs {y.grad_norm:.3f}, relative difference "
                f"{exceeds(_rel(x.grad_norm, y.grad_norm), bound)} ({grad_norm_bound:g} + {GRAD_NORM_PRINTED:g} / "
                "the printed norm)")
    return None


def judge(on: Log, off: Log, loss_rtol: float, grad_norm_rtol: float, judge_until: int,
          noise: Sequence[Log] = (), noise_measured: bool = False,
          unmeasured: str = "the run-to-run drift was not measured") -> dict[str, Any]:
    """Rows per iteration either run logged; the first difference and the first iteration that could
    not be compared among those judged (or None); ``needs_noise``: later iterations that part beyond
    the strict bound while no run-to-run drift was measured (``unmeasured`` says why)."""
    a, b = ({it.iteration: it for it in log.iterations} for log in (on, off))
    labels = ("fusion-on", "fusion-off")
    envelope = _drift_envelope(b, [{it.iteration: it for it in log.iterations} for log in noise], labels[1])
    rows, first, uncompared, needs_noise = [], None, None, []
    for n in sorted(set(a) | set(b)):
        x, y = a.get(n), b.get(n)
        row: dict[str, Any] = {"iteration": n, "judged": n <= judge_until}
        for name in ("loss", "grad_norm", "step_ms"):
            row[name] = [getattr(x, name) if x else None, getattr(y, name) if y else None]
        row["loss_rel"], row["grad_norm_rel"] = _rel(*row["loss"]), _rel(*row["grad_norm"])
        row["noise"] = None
        reason, cannot = None, _not_comparable(x, y, labels)
        if cannot is None:
            reason = _beyond(x, y, loss_rtol, grad_norm_rtol)
            if reason and n != 1:  # past the first step, where both start equal: against the measured drift
                drift = envelope.get(n) if noise_measured else None
                if isinstance(drift, str):
                    reason, cannot = None, drift
                elif drift is not None:
                    row["noise"] = drift
                    reason = _beyond(x, y, max(loss_rtol, NOISE_FACTOR * drift["loss_rel"]),
                                     max(grad_norm_rtol, NOISE_FACTOR * drift["grad_norm_rel"]))
                    if reason:
                        reason += " (3 x the drift of fusion off from its perturbed repeats up to this iteration)"
                else:
                    needs_noise.append(n)
                    reason, cannot = None, f"parts beyond the strict bound ({reason}); {unmeasured}"
        row["differs"], row["not_compared"] = reason, cannot
        if row["judged"]:
            if reason and first is None:
                first = {"iteration": n, "why": reason}
            if cannot and uncompared is None:
                uncompared = {"iteration": n, "why": cannot}
        rows.append(row)
    return {"rows": rows, "first_difference": first, "first_not_compared": uncompared,
            "needs_noise": [n for n in needs_noise if n <= judge_until],
            "judged_iterations": [r["iteration"] for r in rows if r["judged"]]}


def _drift_envelope(off: Mapping[int, Iteration], repeats: Sequence[Mapping[int, Iteration]],
                    label: str) -> dict[int, dict[str, float] | str]:
    """Per iteration of the fusion-off run: the largest relative difference from its repeats at
    that or any earlier iteration (two runs that parted stay apart: one sample per iteration would
    understate it), or why it cannot be measured."""
    out: dict[int, dict[str, float] | str] = {}
    loss, grad_norm = 0.0, 0.0
    for n in sorted(off):
        y = off[n]
        for repeat in repeats:
            z = repeat.get(n)
            cannot = _not_comparable(y, z, (label, f"repeated {label}"))
            if cannot:
                out[n] = f"the run-to-run drift cannot be measured: {cannot}"
                break
            loss = max(loss, _rel(z.loss, y.loss) or 0.0)
            if y.grad_norm:
                grad_norm = max(grad_norm, (abs(z.grad_norm - y.grad_norm) - GRAD_NORM_PRINTED) / abs(y.grad_norm))
        else:
            out[n] = {"loss_rel": loss, "grad_norm_rel": grad_norm}
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(runs: Sequence[Run], result: dict[str, Any], out: TextIO) -> None:
    on, off = runs[:2]
    for run in runs:
        print(f"{run.label}: {run.shown()}\n  exit code {run.rc}, {run.seconds:.1f} s, log {run.log_path}", file=out)
        for line in run.log.gemm_patch_lines[:6]:
            print(f"  {line}", file=out)
        if run.key == "on" and not run.log.gemm_patch_lines and not run.problem():
            print("  (no [gemm_patch] line in this log: is the log level above INFO?)", file=out)
    comparison = result.get("comparison")
    if comparison:
        print(f"\n{'iteration':>9} | {'lm loss on':>12} | {'lm loss off':>12} | {'rel':>8} | {'grad norm on':>12} | "
              f"{'grad norm off':>13} | {'rel':>8} | {'ms on':>8} | {'ms off':>8} |", file=out)
        # after the first two steps a part beyond the drift is weak evidence: said as such
        weak = result.get("verdict") == "drifts"
        for r in comparison["rows"]:
            beyond = "beyond the drift" if weak and r["iteration"] > (on.first_step or 1) + 1 else "differs"
            note = (f"{beyond}: {r['differs']}" if r["differs"] else f"not compared: {r['not_compared']}"
                    if r["not_compared"] else "not judged" if not r["judged"] else
                    f"within 3 x the fusion-off runs' drift (grad norm {r['noise']['grad_norm_rel']:.1e}, "
                    f"lm loss {r['noise']['loss_rel']:.1e})" if r["noise"] else "")
            print(f"{r['iteration']:>9} | {_fmt(r['loss'][0], '12.6E')} | {_fmt(r['loss'][1], '12.6E')} | "
                  f"{_fmt(r['loss_rel'], '8.1e')} | {_fmt(r['grad_norm'][0], '12.3f')} | "
                  f"{_fmt(r['grad_norm'][1], '13.3f')} | {_fmt(r['grad_norm_rel'], '8.1e')} | "
                  f"{_fmt(r['step_ms'][0], '8.1f')} | {_fmt(r['step_ms'][1], '8.1f')} | {note}".rstrip(), file=out)
        ms_on, ms_off = on.log.step_ms(), off.log.step_ms()
        ratio = f", on / off {ms_on / ms_off:.3f}" if ms_on and ms_off else ""
        print(f"\nstep time (median of the logged intervals after the first): on {_fmt(ms_on, '.1f')} ms, "
              f"off {_fmt(ms_off, '.1f')} ms{ratio}", file=out)
        _render_memory(runs[:2], out)
    params, step = result.get("parameters"), on.first_step or 1
    if params:
        if params["judged"]:
            count = params.get("parameters", params["count"])
            blocks = f", {params['count']} records over the ranks" if params["count"] != count else ""
            print(f"\nper parameter at iteration {step} ({count} judged{blocks}, bound max(2^-7, 3 x noise)); worst: "
                  f"{compare_params.describe(params['worst'], _ranks(on))}", file=out)
        else:
            print(f"\nper parameter: global values only: {params['why']}", file=out)
    params2 = result.get("parameters_step2")
    if params2 and params["judged"]:
        if params2["judged"]:
            count = params2.get("parameters", params2["count"])
            print(f"per parameter at iteration {step + 1} ({count} judged, bound max(2^-7, 3 x the perturbed "
                  "reference's)); "
                  f"worst: {compare_params.describe(params2['worst'], _ranks(on))}", file=out)
        else:
            print(f"per parameter at iteration {step + 1}: not judged: {params2['why']}", file=out)
    print(f"\nverdict: {result['summary']}", file=out)


def _ranks(run: Run) -> int:
    return len(run.probe)


def _render_memory(runs: Sequence[Run], out: TextIO) -> None:
    mem = [run.log.last_memory() for run in runs]
    if not any(mem):
        return
    print("memory (megatron's report, MB) | after | allocated | max allocated | reserved | max reserved", file=out)
    for run, m in zip(runs, mem, strict=True):
        if m:
            print(f"  {run.label:<28} | {m.after:>5} | {m.allocated_mb:9.1f} | {m.max_allocated_mb:13.1f} | "
                  f"{m.reserved_mb:8.1f} | {m.max_reserved_mb:12.1f}", file=out)
    if all(mem):
        d = [x - y for x, y in zip(*(astuple_mb(m) for m in mem), strict=True)]
        print(f"  {'on - off':<28} | {'':>5} | {d[0]:+9.1f} | {d[1]:+13.1f} | {d[2]:+8.1f} | {d[3]:+12.1f}", file=out)


def astuple_mb(m: MemoryReport) -> tuple[float, float, float, float]:
    return m.allocated_mb, m.max_allocated_mb, m.reserved_mb, m.max_reserved_mb


def fusion_seen(run: Run) -> list[bool]:
    """The gradient-accumulation fusion settings a run shows: megatron's argument dump, or, where
    the log has none (Megatron-Bridge prints only what differs from its defaults), what the
    gradient probe read from the model's own configuration on every rank."""
    if run.log.fusion:
        return list(run.log.fusion)
    return [value for rec in run.probe.values() for value in rec.get("fusion") or () if isinstance(value, bool)]


def unproven(on: Run, off: Run, off_args: Sequence[str]) -> str | None:
    """What is missing to show that the fusion-on run ran fused under gemm-patch and the fusion-off
    run unfused, or None."""
    fusion = {run.key: fusion_seen(run) for run in (on, off)}
    if not fusion[on.key] or not fusion[off.key]:
        which = " and ".join(r.label for r in (on, off) if not fusion[r.key])
        return (f"cannot find {FUSION_LINE} in the {which} run's log, nor the gradient probe's reading of the "
                "model's configuration: nothing shows that fusion was on in one run and off in the other "
                "(megatron-core prints its arguments at start-up, on rank 0)")
    if not all(fusion[on.key]):
        return f"the {on.label} run ran with gradient_accumulation_fusion False ({FUSION_LINE} or the probe's record)"
    if any(fusion[off.key]):
        return (f"the {off.label} run ran with gradient_accumulation_fusion True ({FUSION_LINE}): the command did "
                f"not pass on {shlex.join(off_args)} (a wrapper script?); --off-arg sets what turns fusion off")
    errors = [line for line in on.log.gemm_patch_lines if line.startswith("[gemm_patch] ERROR")]
    if any(mark in line for line in errors for mark in UNPATCHED_MARKS):
        return f"gemm-patch was not applied in the {on.label} run: {errors[0]}"
    states = [rec.get("gemm_patch", {}) for rec in on.probe.values()]
    if any(s and not s.get("enabled", True) for s in states):
        return f"gemm-patch was turned off (GEMM_PATCH=0) in the {on.label} run (its gradient probe's record)"
    info = [line for line in on.log.gemm_patch_lines if line.startswith("[gemm_patch] INFO")]
    if not info and not any(s.get("applied") for s in states):
        return (f"no sign that gemm-patch was applied in the {on.label} run: no '[gemm_patch] INFO' line in its "
                "log (GEMM_PATCH_LOG_LEVEL above INFO?) and no gradient-probe record saying so")
    return None


def decide(runs: Sequence[Run], args: argparse.Namespace, off_args: Sequence[str]) -> dict[str, Any]:
    """The verdict and exit code. A failed run is a difference when the other run succeeded (the
    two behave differently), unreadable when both failed (nothing to compare against). A perturbed
    reference run that failed or cannot be read is left out, and the verdict says what it could
    therefore not judge."""
    on, off = runs[0], runs[1]
    failed_noise = [run for run in runs[2:] if run.problem()]
    noise = [run for run in runs[2:] if not run.problem()]
    unmeasured = "the run-to-run drift was not measured" + (
        f" ({_failure(failed_noise[0])})" if failed_noise and not noise else "")
    problems = [p for p in (run.problem() for run in (on, off)) if p]
    comparison = None
    if on.log.iterations and off.log.iterations:  # also after a late failure: show what both logged
        comparison = judge(on.log, off.log, args.loss_rtol, args.grad_norm_rtol, args.judge_until,
                           [r.log for r in noise], bool(noise), unmeasured)
    failed = [run for run in (on, off) if run.rc != 0]
    if failed:
        both = len(failed) == 2 or any(run.problem() for run in (on, off) if run.rc == 0)
        return {"verdict": "failed", "exit_code": EXIT_UNREADABLE if both else EXIT_DIFFERS,
                "comparison": comparison, "summary": "; ".join(problems)}
    if problems or comparison is None:
        return {"verdict": "unreadable", "exit_code": EXIT_UNREADABLE, "summary": "; ".join(problems)}
    missing = unproven(on, off, off_args)
    if missing:
        return {"verdict": "not proven", "exit_code": EXIT_UNREADABLE, "comparison": comparison,
                "summary": f"not proven: {missing}"}
    unpaired = None if args.no_probe else probe_pairing(on, off)
    if args.no_probe or unpaired:
        params = params2 = {"judged": False, "why": "--no-probe" if args.no_probe else unpaired}
    else:
        params = compare_params.judge_parameters(on.probe, off.probe, [r.probe for r in noise])
        params2 = second_step(on, off, noise, args, failed_noise)
    s1 = (on.first_step or 1) if params["judged"] else 1
    s2 = s1 + 1
    per_parameter = (f"each parameter's gradient within max(2^-7, 3 x noise){compare_params.unjudged(params)}, "
                     if params["judged"] else "")
    second = (f"; at iteration {s2} each parameter's gradient within max(2^-7, 3 x its difference in the perturbed "
              f"fusion-off run{'s' if len(noise) > 1 else ''})" if params2["judged"] else "")
    rule = (f"at iteration {s1} {per_parameter}lm loss within "
            f"{args.loss_rtol:g} and grad norm within {args.grad_norm_rtol:g} (relative; +{GRAD_NORM_PRINTED:g} for "
            f"the printed grad norm){second}; later iterations up to {args.judge_until} within the same or within "
            f"{NOISE_FACTOR:g} x the drift of fusion off from its perturbed repeats")
    base = {"comparison": comparison, "rule": rule, "parameters": params, "parameters_step2": params2}
    shared = shared_fixes(on, [off, *noise], args.off_patched)
    unjudged = ([] if params["judged"] else [f"global values only: {params['why']}"]) + ([shared] if shared else [])
    scope = f" ({'; '.join(unjudged)})" if unjudged else ""
    step2_lost = bool(failed_noise and not noise and on.probe2 and off.probe2 and not args.no_probe and not unpaired)
    notes = records_not_compared(on, off) + failed_references(failed_noise, f"each parameter at iteration {s2}"
                                                              if step2_lost else None)
    first = comparison["first_difference"]
    for step, judged in ((s1, params), (s2, params2)):
        if first and first["iteration"] < step:
            break
        if judged["judged"] and judged["differs"]:
            why = compare_params.describe(judged["worst"], _ranks(on))
            return {**base, "verdict": "differs", "exit_code": EXIT_DIFFERS,
                    "summary": f"differs at iteration {step}: {why}{notes}",
                    "first_difference": {"iteration": step, "why": why, "parameter": judged["worst"]["parameter"]}}
    if first and first["iteration"] > s2:
        # Past the first two steps every run parts at the model's own pace: one beyond the perturbed
        # runs' drift is weak evidence, however the first two steps were seen (each parameter, or
        # megatron's values alone), not a difference.
        return {**base, "verdict": "drifts", "exit_code": EXIT_DRIFTS,
                "summary": f"drifts at iteration {first['iteration']}: {first['why']}; "
                           f"{agreement(params, params2, comparison, s1)}{scope}: weak evidence (more --noise-runs "
                           f"measure the drift better){notes}"}
    if first:
        return {**base, "verdict": "differs", "exit_code": EXIT_DIFFERS,
                "summary": f"differs at iteration {first['iteration']}: {first['why']}{scope}{notes}"}
    judged, uncompared = comparison["judged_iterations"], comparison["first_not_compared"]
    unlogged = unlogged_iterations(on.log, off.log, min(args.judge_until, args.iters or args.judge_until))
    shown = ", ".join(map(str, unlogged[:5])) + (", ..." if len(unlogged) > 5 else "")
    if judged and not uncompared and unlogged and args.iters and not any(n > 1 for n in judged):
        # Cut to --iters, the logs show nothing after the first step: a defect from the second
        # step on (state carried between steps) cannot show.
        uncompared = {"iteration": unlogged[0],
                      "why": f"iterations {shown} ran but neither log shows them (the command's log interval; "
                             "with it at 1 every iteration up to --judge-until is judged)"}
    if not judged or uncompared:
        why = (f" at iteration {uncompared['iteration']}: {uncompared['why']}{scope}" if judged else
               f": no logged iteration up to {args.judge_until} (--judge-until){scope}")
        return {**base, "verdict": "not compared", "exit_code": EXIT_NOT_COMPARED,
                "summary": f"not compared{why}{notes}"}
    later = len(comparison["rows"]) - len(judged)
    return {**base, "verdict": "same", "exit_code": EXIT_SAME,
            "summary": f"same{scope}: {rule} (iterations {', '.join(map(str, judged))}"
                       + (f"; noise measured by {len(noise)} perturbed fusion-off run{'s' if len(noise) > 1 else ''}"
                          if noise else "") + ")"
                       + (f"; {later} later iteration{'s' if later != 1 else ''} shown, not judged" if later else "")
                       + (f"; iterations {shown} not logged, not judged" if unlogged else "") + notes}


def agreement(params: dict[str, Any], params2: dict[str, Any], comparison: dict[str, Any], first: int) -> str:
    """What agreed at the first two steps, in words: each parameter (the probe), megatron's logged
    values, or nothing compared there."""
    rows = {r["iteration"]: r for r in comparison["rows"]}

    def seen(step: int, judged: dict[str, Any]) -> tuple[str | None, str]:
        """(what agreed at ``step``, or None; why nothing did)"""
        if judged["judged"]:
            return "each parameter", ""
        row = rows.get(step)
        if row and row["judged"] and not row["differs"] and not row["not_compared"]:
            return "megatron's lm loss and grad norm", ""
        return None, (f"not compared: {row['not_compared']}" if row and row["not_compared"] else
                      "neither logged nor recorded by the probe")
    how = [seen(first, params), seen(first + 1, params2)]
    if how[0][0] == how[1][0] == "each parameter":
        return f"every parameter agreed at iterations {first} and {first + 1}"
    if how[0][0] and how[0][0] == how[1][0]:
        return f"{how[0][0]} agreed at iterations {first} and {first + 1}"
    return ", ".join(f"{what} agreed at iteration {step}" if what else f"iteration {step} {why}"
                     for step, (what, why) in ((first, how[0]), (first + 1, how[1])))


def _failure(run: Run) -> str:
    """'the LABEL run failed (exit code N: cause)', or what else makes the run unusable."""
    if run.rc != 0:
        cause = f": {run.log.exception}" if run.log.exception else ""
        return f"the {run.label} run failed (exit code {run.rc}{cause})"
    return run.problem() or ""


def failed_references(failed: Sequence[Run], lost: str | None) -> str:
    """The perturbed reference runs left out, each said, with what their absence left unjudged
    ('' where none failed)."""
    if not failed:
        return ""
    said = "; ".join(_failure(run) for run in failed)
    return f"; {said}, so {lost} was not judged" if lost else f"; {said}: left out"


def probe_pairing(on: Run, off: Run) -> str | None:
    """Why the two runs' first probe records are not of the same step, or None."""
    if on.steps and off.steps and on.first_step != off.first_step:
        return (f"the probe's first record is of iteration {on.first_step} in the {on.label} run and of iteration "
                f"{off.first_step} in the {off.label} run: not the same step, not compared")
    return None


def records_not_compared(on: Run, off: Run) -> str:
    """The probe records of one run that have no record of the same iteration in the other (a
    restarted worker's, say), said as not compared ('' where none)."""
    parts = []
    for run, other in ((on, off), (off, on)):
        if not other.steps:
            continue  # no record at all there: the per-parameter judgement says why
        lone = sorted(n for n in run.steps if n not in other.steps)
        if lone:
            first = grad_probe.first_processes(run.records)
            restarted = all(grad_probe.later_process(rec, first) for n in lone for rec in run.steps[n].values())
            parts.append(f"the probe's records of iteration{'s' if len(lone) > 1 else ''} {', '.join(map(str, lone))} "
                         f"in the {run.label} run{' (a restarted process)' if restarted else ''} not compared: the "
                         f"{other.label} run has none of {'those iterations' if len(lone) > 1 else 'that iteration'}")
        if run.unplaced:
            count = len(run.unplaced)
            parts.append(f"{count} probe record{'s' if count > 1 else ''} of a restarted process in the {run.label} "
                         "run not compared: the iteration is not known (megatron's arguments do not give it)")
    return "".join(f"; {part}" for part in parts)


# gemm-patch's fixes whose code runs only on the fused path (the fused weight-gradient write, the
# kernel or dummy it needs, the embedding lookup written into main_grad, which steps aside where
# the model's fusion is off, NeMo's fusion switch): a fusion-off reference under gemm-patch does
# not reach them, so they stay judged. Every other fix patched in the reference is code both runs
# run, and a defect there cannot show.
FUSED_PATH_ONLY = frozenset({"fsdp-wgrad", "fsdp-wgrad-gemm", "apex-wgrad", "te-dummy-wgrad", "fsdp-embedding-wgrad",
                             "nemo-fsdp-gaf"})


def patched_in(run: Run) -> list[str] | None:
    """The targets a run shows patched: gemm-patch's summary lines and the probe's record of each
    target's state; None where it shows neither."""
    states = [rec["gemm_patch"] for rec in run.records if isinstance(rec.get("gemm_patch"), dict)]
    if not run.log.gemm_patch_lines and not states:
        return None
    names = run.log.patched_targets()
    for state in states:
        if state.get("enabled", True):
            names += [name for name, st in (state.get("targets") or {}).items()
                      if st in PATCHED_STATES or st == BYPASSED]
    return list(dict.fromkeys(names))


def shared_fixes(on: Run, references: Sequence[Run], off_patched: bool) -> str | None:
    """What the verdict cannot judge because the reference ran gemm-patch code that the judged run
    runs too, read from what the reference runs show; None where they ran none."""
    seen = [patched_in(run) for run in references]
    if off_patched and all(names is None for names in seen):
        return ("the reference ran under gemm-patch (--off-patched) and shows neither gemm-patch's summary lines nor "
                "a probe record of what it patched: a defect shared by both runs is not judged")
    judged_run = patched_in(on)
    shared = [name for names in seen for name in names or () if name not in FUSED_PATH_ONLY
              and (judged_run is None or name in judged_run)]
    if not shared:
        return None
    return (f"the reference ran gemm-patch's {', '.join(dict.fromkeys(shared))} too: a defect shared by both runs is "
            "not judged")


def second_step(on: Run, off: Run, noise: Sequence[Run], args: argparse.Namespace,
                failed: Sequence[Run] = ()) -> dict[str, Any]:
    """Each parameter at the second step, judged against the perturbed reference runs (one optimizer
    step from first-step gradients a rounding apart: what a correct fused run may differ by);
    not judged without them."""
    if args.no_probe:
        return {"judged": False, "why": "--no-probe"}
    if not (on.probe2 and off.probe2):
        return {"judged": False, "why": "no second-step record (a run of one step, or no probe)"}
    references = [r.probe2 for r in noise if r.probe2]
    if not references:
        if failed:
            return {"judged": False, "why": f"{_failure(failed[0])}: nothing measured what one step moves"}
        return {"judged": False, "why": "no perturbed fusion-off run to measure what one step moves (--noise-runs 0)"}
    return compare_params.judge_parameters(on.probe2, off.probe2, references)


def _finite(value: Any, path: str, flags: dict[str, str]) -> Any:
    """``value`` with every NaN or infinity replaced by None, each one's path and value in ``flags``."""
    if isinstance(value, float) and not math.isfinite(value):
        flags[path] = str(value)
        return None
    if isinstance(value, dict):
        return {k: _finite(v, f"{path}.{k}" if path else str(k), flags) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v, f"{path}[{i}]", flags) for i, v in enumerate(value)]
    return value


def as_record(command: list[str], runs: Sequence[Run], result: dict[str, Any],
              args: argparse.Namespace) -> dict[str, Any]:
    """What --json prints (schema 2): valid JSON, a non-finite number written as null and named
    with its value in ``not_finite``."""
    comparison = result.get("comparison") or {}
    record = {
        "schema": 2, "command": command, "verdict": result["verdict"], "exit_code": result["exit_code"],
        "summary": result["summary"],
        "first_difference": result.get("first_difference", comparison.get("first_difference")),
        "first_not_compared": result.get("first_not_compared", comparison.get("first_not_compared")),
        "parameters": result.get("parameters"), "parameters_step2": result.get("parameters_step2"),
        "tolerance": {"loss_rtol": args.loss_rtol, "grad_norm_rtol": args.grad_norm_rtol,
                      "grad_norm_printed": GRAD_NORM_PRINTED, "judge_until": args.judge_until,
                      "parameter_bound": compare_params.BF16_BOUND, "noise_factor": NOISE_FACTOR,
                      "perturbation": PERTURBATION},
        "rows": comparison.get("rows", []),
        "runs": {run.key: {"label": run.label, "command": run.command, "env": run.env_changes, "rc": run.rc,
                           "seconds": run.seconds, "log": run.log_path, "step_ms": run.log.step_ms(),
                           "fusion": run.log.fusion, "exception": run.log.exception,
                           "iterations": [asdict(i) for i in run.log.iterations],
                           "memory": [asdict(m) for m in run.log.memory],
                           "gemm_patch_lines": run.log.gemm_patch_lines,
                           "probe": {"folder": run.probe_dir, "ranks": sorted(run.probe),
                                     "iterations": sorted(run.steps), "not_placed": len(run.unplaced)},
                           "tail": run.tail if run.problem() else []} for run in runs},
    }
    flags: dict[str, str] = {}
    record = _finite(record, "", flags)
    record["not_finite"] = flags
    return record


def _positive(kind: type) -> Any:
    """An argparse type: a positive finite number of ``kind`` (int or float)."""
    what = "whole number" if kind is int else "number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {what}, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"expected a positive {what}, got {text!r}")
        return value
    return parse


def _noise_runs(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of runs (0, 1, ...), got {text!r}")
    return value


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    def usage_error(message: str) -> NoReturn:  # one line, exit 2, like compare's own usage errors
        print(f"gemm-patch compare: {message}", file=sys.stderr)
        sys.exit(EXIT_UNREADABLE)

    parser.error = usage_error  # type: ignore[method-assign]
    parser.add_argument("--iters", type=_positive(int), metavar="N",
                        help="cut both runs to N iterations (appends --iters-arg; with the default, also "
                             "--log-interval 1, so that every iteration is logged and judged)")
    parser.add_argument("--iters-arg", default=DEFAULT_ITERS_ARG, metavar="TEMPLATE",
                        help=f"what --iters appends, {{n}} for N (default: '{DEFAULT_ITERS_ARG}'; "
                             "Megatron-Bridge: 'train.train_iters={n}')")
    parser.add_argument("--off-arg", action="append", metavar="ARG",
                        help="what turns fusion off, appended to the fusion-off run (repeatable; default: "
                             "--off-arg=--no-gradient-accumulation-fusion; Bridge/NeMo: "
                             "model.gradient_accumulation_fusion=false)")
    parser.add_argument("--off-patched", action="store_true",
                        help="run the fusion-off run under gemm-patch too (default: GEMM_PATCH=0, megatron as "
                             "shipped); the verdict then names the fixes it ran as well, which it cannot judge")
    parser.add_argument("--loss-rtol", type=_positive(float), default=LOSS_RTOL, metavar="R",
                        help="largest relative difference |on - off| / |off| of megatron's logged lm loss (the mean "
                             f"over the log interval) that counts as the same (default {LOSS_RTOL:g})")
    parser.add_argument("--grad-norm-rtol", type=_positive(float), default=GRAD_NORM_RTOL, metavar="R",
                        help="largest relative difference of megatron's logged global grad norm that counts as the "
                             f"same, plus 0.001 for its 3 printed decimals (default {GRAD_NORM_RTOL:g})")
    parser.add_argument("--judge-until", type=_positive(int), default=JUDGE_UNTIL, metavar="N",
                        help=f"judge the iterations up to N (default {JUDGE_UNTIL}); later ones are shown only")
    parser.add_argument("--noise-runs", type=_noise_runs, default=None, metavar="auto|K",
                        help="run fusion off K more times, its first-step gradients perturbed by a rounding "
                             "(2^-8), to measure the drift that iteration 2 and later ones are judged against "
                             "(default auto: once, where both runs recorded step 2 or an iteration after the "
                             "first parts beyond the strict bound; 0: never, such an iteration is then not "
                             "compared)")
    parser.add_argument("--no-probe", action="store_true",
                        help="don't record each parameter's gradient (GEMM_PATCH_GRAD_PROBE): global values only")
    parser.add_argument("--logs", metavar="DIR", help="where the runs' logs go (default: a new temporary folder)")
    parser.add_argument("--json", nargs="?", const="-", metavar="FILE",
                        help="a JSON record (schema 2): printed instead of the table, or with FILE written there "
                             "beside the table")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="the training command and its arguments")
    return parser


def _usage(command: list[str], args: argparse.Namespace, off_args: list[str]) -> str | None:
    if not command:
        return "no command given: gemm-patch compare [OPTIONS] -- COMMAND [ARGS ...]"
    if "{n}" not in args.iters_arg:
        return f"--iters-arg must contain {{n}} (where N goes), got {args.iters_arg!r}"
    try:
        shlex.split(args.iters_arg)
    except ValueError as exc:
        return f"--iters-arg is not a valid argument list ({exc}): {args.iters_arg!r}"
    carried = [arg for arg in off_args if arg in command]
    if carried:
        return (f"the command already carries {carried[0]}: its fusion-on run would not be fused; "
                "give compare the command as it runs with fusion on")
    if any(GEMM_PATCH_OFF_RE.search(word) for word in command) \
            or os.environ.get("GEMM_PATCH", "").strip().lower() in ("0", "false", "no", "off"):
        return ("GEMM_PATCH=0 (in the command or the environment) turns gemm-patch off in the fusion-on run: "
                "remove it; compare sets it in the fusion-off run itself")
    return None


def unlogged_iterations(on: Log, off: Log, until: int) -> list[int]:
    """The iterations up to ``until`` (and up to the run's length, as megatron's iteration line
    gives it) that both runs ran but neither logged."""
    logged = {it.iteration for log in (on, off) for it in log.iterations}
    totals = [it.of for log in (on, off) for it in log.iterations if it.of]
    last = min([until, *totals])
    return [n for n in range(1, last + 1) if n not in logged]


def output_problem(args: argparse.Namespace) -> str | None:
    """Why --json or --logs cannot be written, found before any run starts; None where both can."""
    if args.json and args.json != "-":
        target = Path(args.json)
        if target.is_dir():
            return f"--json {args.json}: is a folder; give a file name"
        if not target.parent.is_dir():
            return f"--json {args.json}: its folder {target.parent} does not exist"
        if not os.access(target.parent, os.W_OK):
            return f"--json {args.json}: its folder {target.parent} is not writable"
    if args.logs:
        try:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--logs {args.logs}: cannot make that folder ({exc.strerror or exc})"
        if not os.access(args.logs, os.W_OK):
            return f"--logs {args.logs}: not writable"
    return None


def main(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command[:1] == ["--"]:
        command = command[1:]
    off_args = list(args.off_arg) if args.off_arg else list(DEFAULT_OFF_ARGS)
    usage = _usage(command, args, off_args) or output_problem(args)
    if usage:
        print(f"gemm-patch compare: {usage}", file=sys.stderr)
        return EXIT_UNREADABLE
    iters_args = [part.replace("{n}", str(args.iters)) for part in shlex.split(args.iters_arg)] \
        if args.iters is not None else []
    if iters_args and args.iters_arg == DEFAULT_ITERS_ARG:
        # Megatron-LM's own flags: every iteration of the cut runs logged, so every one is judged.
        iters_args += list(EVERY_ITERATION_LOGGED)
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="gemm-patch-compare-"))
    logs.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "PYTHONUNBUFFERED": "1"}
    patched = launch_env(base)
    on_changes = {k: patched[k] for k in ("PYTHONPATH", "GEMM_PATCH_AUTO")}
    if args.off_patched:
        off_env, off_changes, off_shown = patched, on_changes, "gemm-patch run -- "
    elif args.no_probe:
        off_env, off_changes, off_shown = {**base, "GEMM_PATCH": "0"}, {"GEMM_PATCH": "0"}, "GEMM_PATCH=0 "
    else:  # the launcher's hook, for the probe alone: GEMM_PATCH=0 still patches nothing
        off_env = {**patched, "GEMM_PATCH": "0"}
        off_changes, off_shown = {**on_changes, "GEMM_PATCH": "0"}, "GEMM_PATCH=0 gemm-patch run -- "

    def make(key: str, label: str, extra: list[str], changes: dict[str, str], shown: str) -> Run:
        return Run(key, label, command + iters_args + extra, dict(changes), shown, str(logs / f"fusion_{key}.log"))

    runs = [make("on", "fusion on (gemm-patch)", [], on_changes, "gemm-patch run -- "),
            make("off", "fusion off", off_args, off_changes, off_shown)]
    envs = [patched, off_env]
    for run in runs:
        _clear(run.probe_dir)
    started: list[Run] = []
    try:
        with signals_end_runs():
            for run, env in zip(runs, envs, strict=True):
                _start(run, env, args.no_probe, started)
            wanted = args.noise_runs
            if wanted is None:
                first = decide(runs, args, off_args)
                needed = (first.get("comparison") or {}).get("needs_noise")
                # The second step's records are judged against a perturbed reference: one run.
                step2 = not args.no_probe and all(run.probe2 for run in runs[:2])
                wanted = 1 if (needed and first["verdict"] == "not compared") or \
                    (step2 and first["verdict"] in ("same", "not compared", "drifts")) else 0
            perturbed = {} if args.no_probe else {grad_probe.PERTURB_ENV: repr(PERTURBATION)}
            for i in range(1, wanted + 1):
                noise = make(f"off_repeat{i}", f"fusion off, perturbed ({i})", off_args,
                             {**off_changes, **perturbed}, off_shown)
                _clear(noise.probe_dir)
                runs.append(noise)
                _start(noise, {**off_env, **perturbed}, args.no_probe, started)
    except Interrupted as exc:
        print(f"gemm-patch compare: {exc} during the {started[-1].label} run: ended its processes "
              f"(logs in {logs})", file=sys.stderr)
        return 128 + exc.signum
    result = decide(runs, args, off_args)
    if args.json:
        text = json.dumps(as_record(command, runs, result, args), indent=1, allow_nan=False)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    if args.json != "-":
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


def _clear(folder: str) -> None:
    for path in grad_probe.files(folder):
        path.unlink()


def _start(run: Run, env: Mapping[str, str], no_probe: bool, started: list[Run]) -> None:
    started.append(run)
    if not no_probe:
        env = {**env, grad_probe.ENV: run.probe_dir}
        run.env_changes[grad_probe.ENV] = run.probe_dir
    print(f"gemm-patch compare: {run.label}: {run.shown()}", file=sys.stderr, flush=True)
    execute(run, env, sys.stderr)
