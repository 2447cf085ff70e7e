"""Python's garbage collector inside a training process: when each collection started, how long it
took, which generation it swept; and, read beside megatron's log, how much of the timed steps the
collector held the host (a host-bound step waits for it: the GPU has nothing queued meanwhile).

    python -m benchmarks.gc_probe SCRIPT [ARGS...]     # runs SCRIPT as __main__, as `python SCRIPT` would
    torchrun ... -m benchmarks.gc_probe pretrain_gpt.py ARGS...

run from SCRIPT's folder: ``-m`` puts the working directory first on the path, where ``python SCRIPT`` puts
SCRIPT's folder, so its imports resolve as they would.

``BENCH_GC_PROBE=PATH`` names the JSON file the process writes as it exits (unset: SCRIPT only runs).
Only the process that started the probe writes it (a forked data-loader worker does not).
``reading(log_text, probe_text)`` is what benchmarks/pretrain_gpt_bench.py records as ``gc_probe``.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import itertools
import json
import os
import runpy
import sys
import time
from typing import Any

from benchmarks.gpu_clocks import between, iteration_ends

ENV = "BENCH_GC_PROBE"


class Collections:
    """gc.callbacks' pairs of start and stop, kept as [start (Unix s), ms, generation, collected]."""

    def __init__(self) -> None:
        self.rows: list[list[float]] = []
        self._start: tuple[float, float] | None = None

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = (time.time(), time.perf_counter())
        elif self._start is not None:
            wall, t0 = self._start
            self.rows.append([wall, (time.perf_counter() - t0) * 1000.0, info["generation"], info["collected"]])
            self._start = None


def install(path: str) -> Collections:
    """Record every collection from now on; write them to PATH when this process exits."""
    collections = Collections()
    gc.callbacks.append(collections)
    pid = os.getpid()

    def write() -> None:
        if os.getpid() != pid:
            return
        with open(path, "w") as f:
            json.dump({"pid": pid, "thresholds": gc.get_threshold(), "collections": collections.rows}, f)

    atexit.register(write)
    return collections


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m benchmarks.gc_probe SCRIPT [ARGS...]  (BENCH_GC_PROBE=PATH: where to write)",
              file=sys.stderr)
        return 2
    script = args[0]
    if not os.path.isfile(script):
        print(f"benchmarks.gc_probe: {script!r} is not a file: expected the script to run", file=sys.stderr)
        return 2
    if os.path.dirname(os.path.abspath(script)) != os.getcwd():
        print(f"benchmarks.gc_probe: run it from {script!r}'s folder, whose modules the script imports "
              f"(the working directory is {os.getcwd()!r})", file=sys.stderr)
        return 2
    if os.environ.get(ENV):
        install(os.environ[ENV])
    sys.argv = list(args)
    runpy.run_path(script, run_name="__main__")
    return 0


def reading(log_text: str, probe_text: str) -> dict[str, Any] | None:
    """The collector's time between the first and the last logged iteration line (iteration 1's
    start-up left out): in all and per step, by generation, the longest pause, and per logged
    interval [iteration, ms, full collections]; None where the log has fewer than two iteration
    lines or the probe's file is not JSON."""
    ends = iteration_ends(log_text)
    try:
        rows = json.loads(probe_text)["collections"]
    except (ValueError, KeyError, TypeError):
        return None
    if len(ends) < 2:
        return None
    # gpu_clocks' windows (after one logged iteration line, up to the next) over rows with a "time"
    collections = [{"time": datetime.datetime.fromtimestamp(start), "ms": ms, "generation": generation}
                   for start, ms, generation, _ in rows]
    steps = between(collections, ends[0][1], ends[-1][1])
    iterations = ends[-1][0] - ends[0][0]
    by_generation = {str(g): {"count": sum(1 for c in steps if c["generation"] == g),
                              "ms": round(sum(c["ms"] for c in steps if c["generation"] == g), 3)} for g in (0, 1, 2)}
    per_interval = []
    for (_, start), (iteration, end) in itertools.pairwise(ends):
        cs = between(collections, start, end)
        per_interval.append([iteration, round(sum(c["ms"] for c in cs), 3), sum(1 for c in cs if c["generation"] == 2)])
    total = sum(c["ms"] for c in steps)
    return {"ms": round(total, 3), "ms_per_step": round(total / iterations, 3) if iterations else None,
            "longest_ms": round(max((c["ms"] for c in steps), default=0.0), 3), "by_generation": by_generation,
            "by_iteration": per_interval, "from_iteration": ends[0][0], "to_iteration": ends[-1][0],
            "collections_in_process": len(rows)}


if __name__ == "__main__":
    sys.exit(main())
