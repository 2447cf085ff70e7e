"""The width benchmark's probes inside validation/parity/train_gpt_fsdp.py's training loop: a CUDA memory history
from the model's construction to the end of one step (what is alive at that step's peak, who
allocated it, how long it lives), and a torch-profiler trace of the next step (GPU time of the
GEMMs, the reduce-scatters and all-gathers, the element-wise kernels the gradient hooks run).

Enabled per run by ``probe_dir`` (a folder; rank 0 writes ``<name>.memory.json`` and
``<name>.profile.json`` there) and ``probe_step`` (the step whose peak is attributed; the
profile is the step after it). ``te_dummy="fresh"`` is an experiment, not a fix: TE's
``get_dummy_wgrad`` returns a new tensor per call instead of its per-shape cache, to measure
what that cache costs at the peak.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

MAX_ENTRIES = 400_000
# Frames worth naming: the first of these in an allocation's stack says who asked for it.
OWN_CODE = ("megatron", "transformer_engine", "gemm_patch", "train_gpt_fsdp", "megatron_fsdp")


def enabled(run: dict[str, Any]) -> bool:
    return bool(run.get("probe_dir"))


def start_memory_history(run: dict[str, Any]) -> None:
    if enabled(run):
        import torch

        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)


def fresh_te_dummies() -> list[str]:
    """The experiment: every module that bound TE's ``get_dummy_wgrad`` gets gemm_patch's
    per-call one (te-dummy-wgrad's, which that target gives only to Linear/LayerNormLinear).
    Runs under gemm_patch (a patched configuration): importing it applies it."""
    import sys

    base = sys.modules.get("transformer_engine.pytorch.module.base")
    if base is None:
        return []
    from gemm_patch.targets.te_dummy_wgrad import per_call_dummy

    cached = base.get_dummy_wgrad
    replacement = per_call_dummy(cached)
    rebound = []
    for name, module in list(sys.modules.items()):
        if module is not None and getattr(module, "__dict__", {}).get("get_dummy_wgrad") is cached:
            module.get_dummy_wgrad = replacement
            rebound.append(name)
    base._dummy_wgrads.clear()
    return rebound


class StepProbe:
    """``begin(step)`` / ``end(step)`` around each training step."""

    def __init__(self, run: dict[str, Any], rank: int) -> None:
        self.run, self.rank = run, rank
        self.on = enabled(run)
        self.step = int(run.get("probe_step") or 3)
        self.profiler = None
        self.result: dict[str, Any] = {}

    def begin(self, step: int) -> None:
        if not self.on or step != self.step + 1:
            return
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        self.profiler = torch.profiler.profile(activities=acts)
        self.profiler.__enter__()

    def end(self, step: int) -> None:
        if not self.on:
            return
        import torch

        if step == self.step:
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            if self.rank == 0:
                self.result["memory"] = self._write("memory", attribute_peak(snapshot))
        elif step == self.step + 1 and self.profiler is not None:
            torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            if self.rank == 0:
                self.result["profile"] = self._write("profile", summarise_profile(self.profiler))
            self.profiler = None

    def _write(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        folder = Path(self.run["probe_dir"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{self.run['name']}.{kind}.json").write_text(json.dumps(data, indent=1))
        return {k: v for k, v in data.items() if not isinstance(v, list)}


def _who(frames: list[dict[str, Any]]) -> str:
    own = [f for f in frames if any(k in f.get("filename", "") for k in OWN_CODE)]
    pick = own[:3] or frames[:2]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in pick)


def attribute_peak(snapshot: dict[str, Any], top: int = 40) -> dict[str, Any]:
    """Replay the allocation trace of device 0: the allocated bytes over time, the peak, and
    every block alive at the peak with its size, allocating frames, age and remaining life.
    Blocks allocated before recording started are counted, not named (``unattributed_bytes``)."""
    trace = snapshot["device_traces"][0]
    live: dict[int, tuple[int, int]] = {}  # addr -> (size, alloc event index)
    end_of: dict[int, int] = {}  # alloc event index -> free event index
    current = peak = peak_at = unknown_frees = 0
    at_peak: dict[int, tuple[int, int]] = {}
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], i)
            current += ev["size"]
            if current > peak:
                peak, peak_at = current, i
                at_peak = {}  # taken lazily below: copying on every new peak is quadratic
        elif ev["action"] == "free_completed":
            found = live.pop(ev["addr"], None)
            if found is None:
                unknown_frees += ev["size"]
            else:
                end_of[found[1]] = i
            current -= ev["size"]
    for i, ev in enumerate(trace[: peak_at + 1]):  # replay again up to the peak
        if ev["action"] == "alloc":
            at_peak[ev["addr"]] = (ev["size"], i)
        elif ev["action"] == "free_completed":
            at_peak.pop(ev["addr"], None)
    alive, groups = [], defaultdict(lambda: [0, 0])
    for size, i in at_peak.values():
        who = _who(trace[i].get("frames", []))
        alive.append({"bytes": size, "alloc_event": i, "events_before_peak": peak_at - i,
                      "freed_events_after_peak": (end_of[i] - peak_at) if i in end_of else None,
                      "who": who})
        groups[who][0] += size
        groups[who][1] += 1
    alive.sort(key=lambda a: -a["bytes"])
    by_who = sorted(({"who": k, "bytes": v[0], "blocks": v[1]} for k, v in groups.items()),
                    key=lambda g: -g["bytes"])
    return {
        "events": len(trace),
        "peak_event": peak_at,
        "peak_traced_bytes": peak,
        "peak_frame": _who(trace[peak_at].get("frames", [])) if trace else "",
        "frees_of_untraced_bytes": unknown_frees,
        "alive_at_peak_bytes": sum(a["bytes"] for a in alive),
        "largest_alive_at_peak": alive[:top],
        "alive_at_peak_by_frame": by_who[:top],
    }


GEMM_WORDS = ("gemm", "xmma", "cutlass", "nvjet", "matmul")


def kernel_category(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        for kind in ("reducescatter", "allgather", "allreduce"):
            if kind in low.replace("_", ""):
                return f"nccl {kind}"
        return "nccl other"
    if any(w in low for w in GEMM_WORDS):
        return "gemm"
    if "elementwise" in low or "copy" in low or "fill" in low or "add" in low:
        return "elementwise (copies, adds, fills)"
    return "other"


def summarise_profile(prof: Any, top: int = 25) -> dict[str, Any]:
    by_category: dict[str, float] = defaultdict(float)
    kernels = []
    for evt in prof.key_averages():
        cuda_us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if not cuda_us or getattr(evt, "device_type", None) is None:
            continue
        if str(evt.device_type).endswith("CPU"):
            continue
        by_category[kernel_category(evt.key)] += cuda_us
        kernels.append({"kernel": evt.key[:160], "gpu_us": round(cuda_us, 1), "count": evt.count})
    kernels.sort(key=lambda k: -k["gpu_us"])
    return {"gpu_ms_by_category": {k: round(v / 1e3, 3) for k, v in sorted(by_category.items())},
            "top_kernels": kernels[:top]}
