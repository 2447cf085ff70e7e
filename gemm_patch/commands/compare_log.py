"""What ``gemm-patch compare`` reads in one run's output: megatron's ``training_log`` line (printed
on the last rank at iteration 1 and every ``--log-interval``; the loss is the mean over the
interval, the time per iteration the interval's mean)::

     [...] iteration       10/      20 | consumed samples: ... | elapsed time per iteration (ms): 775.3 | ...
       lm loss: 4.276149E+00 | loss scale: 1.0 | grad norm: 0.717 | ... | number of skipped iterations:   0 | ...

its memory report (after iteration 1 and the next logged one; every ``--log-memory-interval``)::

    [Rank 0] (after 10 iterations) memory (MB) | allocated: 323.11 | max allocated: 679.93 | reserved: ...

its argument dump (``  gradient_accumulation_fusion .......... True``; a config printed as YAML or
key=value, ``gradient_accumulation_fusion: true``, is read too), gemm-patch's own ``[gemm_patch]
LEVEL:`` lines, and
the exception a failed worker printed. The same in megatron-core 0.17.1 and 0.19.2 and in
Megatron-Bridge's log. A launcher's line prefix (``[default0]:``, ``[rank0]:``) is allowed.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

ITERATION_RE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")
MEMORY_RE = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| "
                       r"max allocated: ([\d.]+) \| reserved: ([\d.]+) \| max reserved: ([\d.]+)")
GEMM_PATCH_LINE_RE = re.compile(r"\[gemm_patch\] (?:INFO|WARNING|ERROR): .*")
# A target patched, as gemm-patch's summary line names it: ``fsdp-shared-grad verified``,
# ``apex-wgrad provided (apex missing; verified)``; off, unverified and the rest are not patched.
PATCHED_PART_RE = re.compile(r"(?:: |, )([a-z0-9]+(?:-[a-z0-9]+)+) "
                             r"(?:verified|compatible|forced|bypassed|provided|replaced apex)\b")
FUSION_RE = re.compile(r"\bgradient_accumulation_fusion(?:\s+\.+\s+|\s*[:=]\s*)(True|False|true|false)\b")
LAUNCHER_PREFIX_RE = re.compile(r"^(?:\[(?:default|rank)\d+\]:\s?)+")
EXCEPTION_RE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure))(?::\s.*)?$")
# torchrun's own report that a worker failed: the worker's exception, printed before it, is the cause
LAUNCHER_EXCEPTIONS = ("ChildFailedError",)


@dataclass
class Iteration:
    iteration: int
    of: int
    loss: float | None
    grad_norm: float | None
    step_ms: float | None
    skipped: int = 0  # megatron's "number of skipped iterations" of the interval (fp16 loss scaler)
    nan_iterations: int = 0


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
    fusion: list[bool] = field(default_factory=list)  # every gradient_accumulation_fusion value printed
    exception: str | None = None  # the last exception a worker printed (not the launcher's)

    def last_memory(self) -> MemoryReport | None:
        """The latest report of the lowest rank that printed one."""
        if not self.memory:
            return None
        rank = min(m.rank for m in self.memory)
        return max((m for m in self.memory if m.rank == rank), key=lambda m: m.after)

    def patched_targets(self) -> list[str]:
        """The targets gemm-patch's summary lines (INFO, WARNING) name as patched, in their order."""
        found = [m.group(1) for line in self.gemm_patch_lines if not line.startswith("[gemm_patch] ERROR")
                 for m in PATCHED_PART_RE.finditer(line)]
        return list(dict.fromkeys(found))

    def step_ms(self) -> float | None:
        """Median of the logged per-iteration times after the first line (iteration 1 holds start-up)."""
        times = [it.step_ms for it in self.iterations[1:] if it.step_ms is not None]
        return statistics.median(times) if times else None


def _number(fields: Mapping[str, str], key: str) -> float | None:
    try:
        return float(fields[key])
    except (KeyError, ValueError):
        return None


def _count(fields: Mapping[str, str], key: str) -> int:
    value = _number(fields, key)
    return int(value) if value is not None and value == value else 0


def parse_log(text: str) -> Log:
    """Everything compare reads in one run's output. An iteration logged twice (a restarted rank)
    keeps its first line."""
    log, seen = Log(), set()
    in_traceback, exceptions = False, []
    for raw in text.splitlines():
        line = LAUNCHER_PREFIX_RE.sub("", raw)
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
            continue
        m = EXCEPTION_RE.match(line)
        if m and (in_traceback or not line.startswith(" ")):
            in_traceback = False
            exceptions.append(line.strip())
            continue
        m = ITERATION_RE.search(line)
        if m and int(m.group(1)) not in seen:
            fields = dict(part.strip().split(": ", 1) for part in m.group(3).split("|") if ": " in part)
            seen.add(int(m.group(1)))
            log.iterations.append(Iteration(int(m.group(1)), int(m.group(2)), _number(fields, "lm loss"),
                                            _number(fields, "grad norm"),
                                            _number(fields, "elapsed time per iteration (ms)"),
                                            _count(fields, "number of skipped iterations"),
                                            _count(fields, "number of nan iterations")))
            continue
        m = MEMORY_RE.search(line)
        if m:
            log.memory.append(MemoryReport(int(m.group(1)), int(m.group(2)), *map(float, m.groups()[2:])))
            continue
        m = GEMM_PATCH_LINE_RE.search(line)
        if m:
            if m.group(0) not in log.gemm_patch_lines:
                log.gemm_patch_lines.append(m.group(0))
            continue
        m = FUSION_RE.search(line)
        if m:
            log.fusion.append(m.group(1).lower() == "true")
    workers = [e for e in exceptions if not any(name in e for name in LAUNCHER_EXCEPTIONS)]
    log.exception = (workers or exceptions or [None])[-1]
    return log
