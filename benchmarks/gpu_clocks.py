"""What the GPU ran at while a benchmark process ran: nvidia-smi sampled twice a second beside it.

A step time that wanders from iteration to iteration may be the GPU lowering its clock (power or
heat), or the GPU waiting for the host, rather than the code; these readings let a record say which.
The clock is summarised over the samples taken while the GPU was busy (utilization at least
BUSY_PERCENT): start-up and the pauses between processes idle the clock down and say nothing about
the steps. How busy the GPU was during the steps is read over the samples between megatron's first
and last logged iteration lines (``steps_utilization``): nvidia-smi's utilization is the share of
its sample period in which a kernel ran, so its mean there is the share of the steps' time the GPU
computed, and the rest is time it waited for the host (launches, Python, synchronisations).

    with GpuClocks(path) as clocks:
        run the process
    clocks.summary(log_text)  # {"samples": ..., "sm_mhz_median": ..., "by_iteration": ...}, {"error": ...} or None
    python -m benchmarks.gpu_clocks NAME.log NAME.gpu.csv   # the same reading of a kept log and its samples
    python -m benchmarks.gpu_clocks --refresh RECORDS.jsonl LOGDIR
        # each record whose log (NAME.log) and samples (NAME.gpu.csv) are in LOGDIR gets this reading
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


def iteration_ends(log_text: str) -> list[tuple[int, datetime.datetime]]:
    """(iteration, time) of each of megatron's logged iteration lines."""
    return [(int(m.group(2)), datetime.datetime.fromisoformat(m.group(1))) for m in ITERATION_END.finditer(log_text)]


def between(samples: list[dict[str, Any]], start: datetime.datetime, end: datetime.datetime) -> list[dict[str, Any]]:
    return [r for r in samples if r["time"] is not None and start < r["time"] <= end]


def by_iteration(log_text: str, samples_text: str) -> list[list[float | None]]:
    """[iteration, median SM MHz, median W, mean utilization %] over the samples taken since the
    previous logged iteration line (None where none fell there): the clock and how busy the GPU was
    beside each logged interval's time."""
    samples = readings(samples_text)
    out: list[list[float | None]] = []
    for (_, start), (iteration, end) in itertools.pairwise(iteration_ends(log_text)):
        inside = between(samples, start, end)
        out.append([iteration, statistics.median(r["clocks.sm"] for r in inside) if inside else None,
                    round(statistics.median(r["power.draw"] for r in inside), 1) if inside else None,
                    round(statistics.fmean(r["utilization.gpu"] for r in inside), 1) if inside else None])
    return out


def steps_utilization(log_text: str, samples_text: str) -> dict[str, Any] | None:
    """The GPU's utilization over the samples between the first and the last logged iteration line
    (iteration 1's start-up left out): mean and median %, and the number of samples; None where
    no sample fell there."""
    ends = iteration_ends(log_text)
    inside = between(readings(samples_text), ends[0][1], ends[-1][1]) if len(ends) > 1 else []
    if not inside:
        return None
    busy = [r["utilization.gpu"] for r in inside]
    return {"mean_percent": round(statistics.fmean(busy), 1), "median_percent": statistics.median(busy),
            "samples": len(busy), "from_iteration": ends[0][0], "to_iteration": ends[-1][0]}


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
        return reading(log_text, samples)


def reading(log_text: str, samples: str) -> dict[str, Any]:
    """summarise()'s reading of the samples, with by_iteration() and steps_utilization() against
    LOG_TEXT (megatron's log) where it has lines."""
    said = summarise(samples)
    if "sm_mhz_median" in said and (iterations := by_iteration(log_text, samples)):
        said["by_iteration"] = iterations
    if "error" not in said and (steps := steps_utilization(log_text, samples)):
        said["steps_utilization"] = steps
    return said


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="The GPU's reading beside a kept megatron log: clock, power, and "
                                "how busy the GPU was during the steps.")
    p.add_argument("log", type=Path, nargs="?", help="the process's log (NAME.log)")
    p.add_argument("samples", type=Path, nargs="?", help="its nvidia-smi samples (NAME.gpu.csv)")
    p.add_argument("--refresh", type=Path, nargs=2, metavar=("RECORDS", "LOGDIR"),
                   help="rewrite gpu_clocks of each record of RECORDS (pretrain_gpt_bench's JSONL) whose "
                        "NAME.log and NAME.gpu.csv are in LOGDIR")
    a = p.parse_args(argv)
    if a.refresh:
        records_path, logdir = a.refresh
        lines = records_path.read_text().splitlines()
        refreshed = 0
        for n, line in enumerate(lines):
            record = json.loads(line) if line.strip() else None
            name = Path(record.get("log") or "").name if record else ""
            log, samples = logdir / name, logdir / (name.removesuffix(".log") + ".gpu.csv")
            if name and log.is_file() and samples.is_file():
                record["gpu_clocks"] = reading(log.read_text(errors="replace"), samples.read_text(errors="replace"))
                lines[n] = json.dumps(record)
                refreshed += 1
        records_path.write_text("\n".join(lines) + "\n")
        print(f"{records_path}: {refreshed} record(s) read again from {logdir}")
        return 0
    if a.log is None or a.samples is None:
        p.error("give a log and its samples (NAME.log NAME.gpu.csv), or --refresh RECORDS LOGDIR")
    print(json.dumps(reading(a.log.read_text(errors="replace"), a.samples.read_text(errors="replace"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
