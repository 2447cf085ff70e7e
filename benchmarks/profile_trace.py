#!/usr/bin/env python
"""Where a step's time goes, from a PyTorch profiler trace (Chrome JSON, ``.json`` or ``.json.gz``),
per profiled step: the host's wall time (the profiler's ``ProfilerStep#N`` ranges), the GPU's busy
time (the union of kernel, memcpy and memset intervals), kernel time by kind (GEMM, NCCL,
attention, the rest) and the kernels that took longest, and the host time spent in gemm_patch's own
Python frames (recorded only with ``with_stack=True``; megatron's
``--pytorch-profiler-collect-callstack``): self time (the frame less everything it called) and the
outermost frames' whole time (with the work they hand on, the GEMM launch included), and the
self time by gemm_patch module (which fix or layer spends it).

And where the GPU waits: its idle time per step (the step's range less its busy time), and, for
each host frame or operator, the part of its self time during which the GPU was idle (``idle_by_frame``:
what the host was doing while nothing ran), and the CUDA runtime calls that wait for the GPU
(``syncs``: ``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, blocking
``cudaMemcpy``, ``cudaFree``) with their count and time per step.

These are sums of durations, so they do not move with the host's drift the way a step's wall time
does: two configurations' kernel times can be compared at a few tenths of a percent where their
step times scatter by tens of percent.

    python -m benchmarks.profile_trace TRACE [TRACE ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
KINDS = (  # the first match names a kernel's kind
    ("nccl", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attn|attention|cudnn_generated_fort_native_sdpa", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|s16816|s1688|wgmma|matmul", re.I)),
)
OWN_FRAME = re.compile(r"(?:^|[/\\])gemm_patch[/\\][\w/\\]*\.py\(\d+\)")
STEP = re.compile(r"^ProfilerStep#(\d+)$")
TOP_KERNELS = 8
TOP_IDLE_FRAMES = 15
SYNC_CALLS = re.compile(r"^cuda(StreamSynchronize|DeviceSynchronize|EventSynchronize|Memcpy|Free)\b")


def load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def kind(name: str) -> str:
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def module_of(frame: str) -> str:
    """'.../gemm_patch/targets/shared_grad.py(41)' -> 'targets/shared_grad.py': which fix or layer."""
    path = frame.replace("\\", "/").rsplit("(", 1)[0]
    return path[path.rindex("gemm_patch/") + len("gemm_patch/"):]


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def per_thread(events: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The events of each thread, in start order, an enclosing range before what it encloses."""
    threads: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        threads[(e.get("pid"), e.get("tid"))].append(e)
    return [sorted(thread, key=lambda e: (e["ts"], -e["dur"])) for thread in threads.values()]


def self_times(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
    """(event, its duration less its direct children's) for host events, nesting per thread."""
    out: list[tuple[dict[str, Any], float]] = []
    for thread in per_thread(e for e in events if not str(e.get("cat", "")).startswith(("gpu_", "kernel"))):
        stack: list[list] = []  # [event, end, children's time]
        for e in thread:
            while stack and e["ts"] >= stack[-1][1]:
                done = stack.pop()
                out.append((done[0], done[0]["dur"] - done[2]))
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e, e["ts"] + e["dur"], 0.0])
        out += [(e, e["dur"] - children) for e, _, children in stack]
    return out


def complement(intervals: list[tuple[float, float]], start: float, stop: float) -> list[tuple[float, float]]:
    """The parts of [start, stop) that no interval covers, in order."""
    out, at = [], start
    for a, b in sorted(intervals):
        if b <= at:
            continue
        if a >= stop:
            break
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < stop:
        out.append((at, stop))
    return out


class Overlap:
    """Length of [a, b) covered by a fixed set of disjoint, sorted intervals, in O(log n)."""

    def __init__(self, intervals: list[tuple[float, float]]) -> None:
        import bisect
        import itertools

        self._bisect = bisect.bisect_right
        self.starts = [a for a, _ in intervals]
        self.ends = [b for _, b in intervals]
        self.prefix = [0.0, *itertools.accumulate(b - a for a, b in intervals)]

    def _upto(self, t: float) -> float:
        i = self._bisect(self.starts, t)  # intervals starting at or before t
        if i == 0:
            return 0.0
        return self.prefix[i - 1] + min(t, self.ends[i - 1]) - self.starts[i - 1]

    def __call__(self, a: float, b: float) -> float:
        return max(0.0, self._upto(b) - self._upto(a))


def idle_by_frame(events: list[dict[str, Any]], idle: list[tuple[float, float]]) -> dict[str, float]:
    """Per host event name, the part of its self time (less its direct children) during which
    the GPU was idle, in us."""
    covered = Overlap(idle)
    out: dict[str, float] = defaultdict(float)
    host = (e for e in events if e.get("cat") in ("python_function", "cpu_op", "cuda_runtime", "cuda_driver",
                                                  "user_annotation") and not STEP.match(e["name"]))
    for thread in per_thread(host):
        stack: list[list] = []  # [event, end, children's idle]
        for e in thread:
            while stack and e["ts"] >= stack[-1][1]:
                done = stack.pop()
                out[done[0]["name"]] += covered(done[0]["ts"], done[1]) - done[2]
            mine = covered(e["ts"], e["ts"] + e["dur"])
            if stack:
                stack[-1][2] += mine
            stack.append([e, e["ts"] + e["dur"], 0.0])
        for e, end, children in stack:
            out[e["name"]] += covered(e["ts"], end) - children
    return out


def outermost_own_us(events: list[dict[str, Any]]) -> tuple[float, int]:
    """Whole time of gemm_patch frames not inside another gemm_patch frame, and how many."""
    total, count = 0.0, 0
    for thread in per_thread(e for e in events if e.get("cat") == "python_function" and OWN_FRAME.search(e["name"])):
        end = float("-inf")
        for e in thread:
            if e["ts"] >= end:
                total, count, end = total + e["dur"], count + 1, e["ts"] + e["dur"]
    return total, count


def analyse(events: list[dict[str, Any]]) -> dict[str, Any]:
    # The profiler marks each step twice: on the host (user_annotation) and on the GPU's timeline
    # (gpu_user_annotation); the host's range is the step.
    steps = [e for e in events if e.get("cat") == "user_annotation" and STEP.match(e["name"])]
    if not steps:
        raise ValueError("no ProfilerStep#N range in the trace: it is not from a scheduled torch.profiler run "
                         "(megatron's --profile --use-pytorch-profiler writes one)")
    n = len(steps)
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    kinds: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        if e["cat"] == "kernel":
            kinds[kind(e["name"])] += e["dur"]
            per_kernel[e["name"]][0] += e["dur"]
            per_kernel[e["name"]][1] += 1
        else:
            kinds[e["cat"]] += e["dur"]
    own_by_module: dict[str, float] = defaultdict(float)
    for e, t in self_times(events):
        match = OWN_FRAME.search(e["name"]) if e.get("cat") == "python_function" else None
        if match:
            own_by_module[module_of(match.group(0))] += t
    own_self = sum(own_by_module.values())
    own_whole, own_calls = outermost_own_us(events)
    ms = 1e-3 / n
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    busy = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
    idle = [gap for s in steps for gap in complement(busy, s["ts"], s["ts"] + s["dur"])]
    by_frame = idle_by_frame(events, idle)
    syncs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and SYNC_CALLS.match(e["name"]):
            syncs[e["name"]][0] += e["dur"]
            syncs[e["name"]][1] += 1
    return {
        "steps": n, "step_numbers": sorted(int(STEP.match(e["name"]).group(1)) for e in steps),
        "host_step_ms": round(sum(e["dur"] for e in steps) * ms, 3),
        "gpu_busy_ms": round(union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu]) * ms, 3),
        "kernel_ms": round(sum(e["dur"] for e in gpu if e["cat"] == "kernel") * ms, 3),
        "kernels_per_step": round(sum(1 for e in gpu if e["cat"] == "kernel") / n, 1),
        "by_kind_ms": {k: round(v * ms, 3) for k, v in sorted(kinds.items())},
        "top_kernels": [{"name": name[:120], "ms": round(t * ms, 3), "calls": round(c / n, 1)}
                        for name, (t, c) in top],
        "python_frames": any(e.get("cat") == "python_function" for e in events),
        "gemm_patch_self_ms": round(own_self * ms, 3),
        "gemm_patch_outermost_ms": round(own_whole * ms, 3),
        "gemm_patch_calls_per_step": round(own_calls / n, 1),
        "gemm_patch_self_ms_by_module": {m: round(t * ms, 3) for m, t in
                                         sorted(own_by_module.items(), key=lambda kv: -kv[1])},
        "gpu_idle_ms": round(sum(b - a for a, b in idle) * ms, 3),
        "idle_by_frame_ms": {name[:160]: round(t * ms, 3) for name, t in
                             sorted(by_frame.items(), key=lambda kv: -kv[1])[:TOP_IDLE_FRAMES] if t > 0},
        "syncs": {name: {"ms": round(t * ms, 3), "calls": round(c / n, 1)} for name, (t, c) in sorted(syncs.items())},
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    names = list(results)
    rows = [("steps", "steps"), ("host step ms", "host_step_ms"), ("GPU busy ms", "gpu_busy_ms"),
            ("GPU idle ms", "gpu_idle_ms"),
            ("kernel ms", "kernel_ms"), ("kernels per step", "kernels_per_step")]
    kinds = sorted({k for r in results.values() for k in r["by_kind_ms"]})
    lines = ["per step | " + " | ".join(names), "---|" + "---|" * len(names)]
    lines += [f"{label} | " + " | ".join(str(results[n][key]) for n in names) for label, key in rows]
    lines += [f"{k} ms | " + " | ".join(str(results[n]["by_kind_ms"].get(k, 0.0)) for n in names) for k in kinds]
    lines += [f"{label} | " + " | ".join(str(results[n][key]) if results[n]["python_frames"] else "-" for n in names)
              for label, key in (("gemm_patch self ms", "gemm_patch_self_ms"),
                                 ("gemm_patch outermost ms", "gemm_patch_outermost_ms"),
                                 ("gemm_patch calls", "gemm_patch_calls_per_step"))]
    modules = sorted({m for r in results.values() for m in r.get("gemm_patch_self_ms_by_module", {})})
    lines += [f"  self ms in {m} | " + " | ".join(str(results[n]["gemm_patch_self_ms_by_module"].get(m, 0.0))
                                               for n in names) for m in modules]
    frames = sorted({f for r in results.values() for f in r.get("idle_by_frame_ms", {})})
    lines += [f"  GPU idle in {f} | " + " | ".join(str(results[n].get("idle_by_frame_ms", {}).get(f, "-"))
                                                 for n in names) for f in frames]
    calls = sorted({c for r in results.values() for c in r.get("syncs", {})})
    lines += [f"  {c} ms (calls) | " + " | ".join(
        (lambda v: f"{v['ms']} ({v['calls']})" if v else "-")(results[n].get("syncs", {}).get(c)) for n in names)
        for c in calls]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--json", type=Path, help="write the results here as JSON, keyed by trace path")
    a = p.parse_args(argv)
    results = {}
    for path in a.traces:
        try:
            results[str(path)] = analyse(load(path))
        except (OSError, ValueError, KeyError) as e:
            print(f"profile_trace: {path}: {e}", file=sys.stderr)
            return 2
    print(table(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
