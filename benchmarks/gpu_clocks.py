"""What the GPU ran at while a benchmark process ran: nvidia-smi sampled twice a second beside it.

A step time that wanders from iteration to iteration may be the GPU lowering its clock (power or
heat) rather than the code; these readings let a record say which. Only samples taken while the GPU
was busy (utilization at least BUSY_PERCENT) are summarised: start-up and the pauses between
processes idle the clock down and say nothing about the steps.

    with GpuClocks(path) as clocks:
        run the process
    clocks.summary(log_text)  # {"samples": ..., "sm_mhz_median": ..., "by_iteration": ...}, {"error": ...} or None
"""

from __future__ import annotations

import datetime
import itertools
import os
import re
import statistics
import subprocess
from pathlib import Path
from typing import Any

# The timestamp lines the samples up with megatron's timestamped iteration lines in the log.
FIELDS = ("timestamp", "utilization.gpu", "clocks.sm", "clocks.max.sm", "power.draw", "power.limit",
          "temperature.gpu")
BUSY_PERCENT = 50.0
INTERVAL_MS = 500
SAMPLE_TIME = "%Y/%m/%d %H:%M:%S.%f"
# megatron's logged iteration line: "[2026-12-07 05:00:00.123456] iteration        5/      20 | ..."
ITERATION_END = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration\s+(\d+)/")


def gpu_index() -> str:
    """The GPU the process sees first: CUDA_VISIBLE_DEVICES' first entry where it is a number, else 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return first if first.isdigit() else "0"


def readings(text: str) -> list[dict[str, Any]]:
    """nvidia-smi's CSV lines (FIELDS, no header, no units), each a dict with the sample's time (None where
    it reads otherwise); a line with "[N/A]" or a message instead of numbers is left out."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(FIELDS):
            continue
        try:
            row: dict[str, Any] = dict(zip(FIELDS[1:], map(float, cells[1:]), strict=True))
        except ValueError:
            continue
        try:
            row["time"] = datetime.datetime.strptime(cells[0], SAMPLE_TIME)
        except ValueError:
            row["time"] = None
        rows.append(row)
    return rows


def by_iteration(log_text: str, samples_text: str) -> list[list[float | None]]:
    """[iteration, median SM MHz, median W] over the samples taken since the previous logged iteration
    line (None where none fell there): the clock beside each logged interval's time."""
    ends = [(int(m.group(2)), datetime.datetime.fromisoformat(m.group(1)))
            for m in ITERATION_END.finditer(log_text)]
    samples = readings(samples_text)
    out: list[list[float | None]] = []
    for (_, start), (iteration, end) in itertools.pairwise(ends):
        inside = [r for r in samples if r["time"] is not None and start < r["time"] <= end]
        out.append([iteration, statistics.median(r["clocks.sm"] for r in inside) if inside else None,
                    round(statistics.median(r["power.draw"] for r in inside), 1) if inside else None])
    return out


def summarise(text: str) -> dict[str, Any]:
    """readings() -> medians and extremes over the busy samples."""
    rows = readings(text)
    if not rows:
        first = text.strip().splitlines()[0] if text.strip() else "no output"
        return {"error": f"nvidia-smi gave no reading: {first[:200]}"}
    busy = [r for r in rows if r["utilization.gpu"] >= BUSY_PERCENT]
    if not busy:
        return {"samples": len(rows), "busy_samples": 0}
    sm = [r["clocks.sm"] for r in busy]
    power = [r["power.draw"] for r in busy]
    return {
        "samples": len(rows), "busy_samples": len(busy),
        "sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm), "sm_mhz_rated_max": busy[0]["clocks.max.sm"],
        "power_w_median": round(statistics.median(power), 1), "power_w_max": max(power),
        "power_limit_w": busy[0]["power.limit"],
        "temperature_c_max": max(r["temperature.gpu"] for r in busy),
    }


class GpuClocks:
    """Samples the GPU into PATH while the block runs; summary() reads them (None without nvidia-smi)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc: subprocess.Popen[bytes] | None = None
        self.missing = False

    def __enter__(self) -> GpuClocks:
        try:
            with open(self.path, "wb") as out:
                self.proc = subprocess.Popen(
                    ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                     "-i", gpu_index(), "-lms", str(INTERVAL_MS)],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except OSError:
            self.missing = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def summary(self, log_text: str = "") -> dict[str, Any] | None:
        """summarise()'s reading, with by_iteration() against LOG_TEXT (megatron's log) where it has lines."""
        if self.missing:
            return None
        try:
            samples = self.path.read_text(errors="replace")
        except OSError as e:
            return {"error": f"{self.path}: {e}"}
        said = summarise(samples)
        if "sm_mhz_median" in said and (iterations := by_iteration(log_text, samples)):
            said["by_iteration"] = iterations
        return said
