#!/usr/bin/env python
"""Where a training step's memory peak falls and what is alive there, read from a snapshot of
torch's CUDA caching allocator taken with its history on (``torch.cuda.memory._snapshot()`` after
``_record_memory_history``: megatron's ``--record-memory-history --memory-snapshot-path``).

    python -m benchmarks.memory_peak SNAPSHOT.pickle [--top N]      # prints the reading as JSON

The snapshot holds the blocks alive when it was taken (``segments``) and the allocator's last
events (``device_traces``: alloc, free_completed, ...). Replaying the events forward from the
level they must have started at (what is alive at the end, less what they added) gives the
allocated bytes after each event; the peak is the highest. What is alive there is what the
window allocated and had not freed yet, plus what was allocated before it (the blocks alive at
the end that no event of the window allocated, and those the window frees after the peak).
Blocks are grouped by their site: the innermost frame of megatron, Transformer Engine or
gemm_patch in the stack that allocated them (``before the recorded history`` where none is known).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path
from typing import Any

MIB = 1024.0 * 1024.0
GIB = MIB * 1024.0
OWNERS = ("/gemm_patch/", "/megatron/", "/transformer_engine/")
UNKNOWN = "before the recorded history"


def load(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return pickle.load(f)


def site(frames: list[dict[str, Any]] | None) -> str:
    """``file:line function`` of the innermost frame of megatron, TE or gemm_patch; else the innermost
    frame at all; UNKNOWN without frames."""
    if not frames:
        return UNKNOWN
    frame = next((f for f in frames if any(o in f.get("filename", "") for o in OWNERS)), frames[0])
    name = frame.get("filename", "?")
    for owner in OWNERS:  # the path from the package on: the same site in every environment
        if owner in name:
            name = owner.strip("/") + "/" + name.split(owner, 1)[1]
            break
    return f"{name}:{frame.get('line', '?')} {frame.get('name', '?')}"


def by_gemm_patch(frames: list[dict[str, Any]] | None) -> bool:
    return any("/gemm_patch/" in f.get("filename", "") for f in frames or ())


def alive_at_end(snapshot: dict[str, Any], device: int) -> dict[int, tuple[int, list[dict[str, Any]] | None]]:
    """address -> (size, frames) of every allocated block of ``device`` when the snapshot was taken."""
    alive = {}
    for segment in snapshot.get("segments", []):
        if segment.get("device", device) != device:
            continue
        address = segment["address"]
        for block in segment.get("blocks", []):
            if block.get("state") == "active_allocated":
                alive[block.get("address", address)] = (block["size"], block.get("frames"))
            address += block["size"]
    return alive


def analyse(snapshot: dict[str, Any], device: int = 0, top: int = 12) -> dict[str, Any]:
    """The peak of the recorded window and what is alive there (module docstring)."""
    traces = snapshot.get("device_traces") or []
    events = [e for e in (traces[device] if device < len(traces) else []) if e.get("action") in
              ("alloc", "free_completed")]
    end = alive_at_end(snapshot, device)
    if not events:
        raise ValueError("the snapshot holds no allocator events: was it taken with the history on "
                         "(megatron's --record-memory-history)?")
    allocated_in_window: set[int] = set()
    level = 0
    for e in events:
        level += e["size"] if e["action"] == "alloc" else -e["size"]
    start = sum(size for size, _ in end.values()) - level
    level, peak, peak_at = start, start, -1
    for i, e in enumerate(events):
        level += e["size"] if e["action"] == "alloc" else -e["size"]
        if level > peak:
            peak, peak_at = level, i
    # What is alive after event peak_at: replay up to it, keeping each live block's frames.
    live: dict[int, tuple[int, list[dict[str, Any]] | None]] = {}
    for e in events[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames"))
            allocated_in_window.add(e["addr"])
        else:  # a block of the window, or one of before it (not counted: freed before the peak)
            live.pop(e["addr"], None)
    later_allocs = {e["addr"] for e in events[peak_at + 1:] if e["action"] == "alloc"}
    older: dict[int, tuple[int, list[dict[str, Any]] | None]] = {}
    at_peak, since = set(live), set()  # the window's blocks alive at the peak; those allocated after it
    for e in events[peak_at + 1:]:
        if e["action"] == "alloc":
            since.add(e["addr"])
        elif e["addr"] in since:
            since.discard(e["addr"])
        elif e["addr"] in at_peak:
            at_peak.discard(e["addr"])
        else:  # freed after the peak, allocated before the window
            older[e["addr"]] = (e["size"], None)
    for addr, (size, frames) in end.items():  # alive from before the window to the end
        if addr not in allocated_in_window and addr not in later_allocs:
            older[addr] = (size, frames)
    blocks = list(live.values()) + list(older.values())
    groups: dict[str, list[int]] = {}
    for size, frames in blocks:
        g = groups.setdefault(site(frames), [0, 0])
        g[0] += size
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    event = events[peak_at] if peak_at >= 0 else None
    return {
        "peak_gib": round(peak / GIB, 4), "window_start_gib": round(start / GIB, 4),
        "end_gib": round(sum(size for size, _ in end.values()) / GIB, 4), "events": len(events),
        "peak_event": None if event is None else {"size_mib": round(event["size"] / MIB, 2),
                                                  "site": site(event.get("frames")),
                                                  "stack": [site([f]) for f in (event.get("frames") or [])
                                                            if any(o in f.get("filename", "") for o in OWNERS)][:8]},
        "alive": [{"site": name, "mib": round(size / MIB, 2), "blocks": count}
                  for name, (size, count) in ranked[:top]],
        "alive_other_mib": round(sum(size for _, (size, _) in ranked[top:]) / MIB, 2),
        "gemm_patch_mib": round(sum(size for size, frames in blocks if by_gemm_patch(frames)) / MIB, 2),
        "gemm_patch_sites": _gemm_patch_sites(blocks),
    }


def _gemm_patch_sites(blocks: list[tuple[int, list[dict[str, Any]] | None]]) -> dict[str, float]:
    """MiB alive per innermost gemm_patch frame, for the blocks allocated under gemm_patch's frames."""
    sites: dict[str, float] = {}
    for size, frames in blocks:
        inner = next((f for f in frames or () if "/gemm_patch/" in f.get("filename", "")), None)
        if inner is not None:
            name = site([inner])
            sites[name] = round(sites.get(name, 0.0) + size / MIB, 2)
    return sites


def peak_table(records: list[dict[str, Any]], top: int = 3) -> str:
    """Markdown: per run recorded with the allocator's history, the step's peak, the allocation it
    fell at, the largest sites alive there and what of it was allocated under gemm_patch's frames."""
    def short(name: str) -> str:  # file:line function, without the package path
        return name.rsplit("/", 1)[-1]

    rows = ["| model, megatron-core, embeddings | configuration | GPU | peak GiB "
            "| the peak's allocation (and its caller in the model) | largest alive there (MiB) "
            "| under gemm_patch's frames (MiB) |",
            "|---|---|---|---|---|---|---|"]
    for r in records:
        peak = r.get("memory_peak")
        if r.get("rc") != 0 or not peak or not peak.get("peak_event"):
            continue
        stack = peak["peak_event"]["stack"]
        model = next((s for s in stack if "/models/" in s), None)
        where = short(peak["peak_event"]["site"]) + (f" (in {short(model)})" if model and model != stack[0] else "")
        alive = "; ".join(f"{short(a['site'])} {a['mib']:,.0f}" for a in peak["alive"][:top])
        mine = f"{peak['gemm_patch_mib']:,.0f}"
        if peak.get("gemm_patch_sites"):
            mine += " (" + "; ".join(f"{short(k)} {v:,.0f}" for k, v in peak["gemm_patch_sites"].items()) + ")"
        model_name = r.get("size") or f"hidden {r['hidden']}"
        rows.append(f"| {model_name}, {r['release']}, {'tied' if r['tied'] else 'untied'} | {r['config']} | "
                    f"{r.get('device') or '-'} | {peak['peak_gib']:.2f} | {where} | {alive} | {mine} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", type=Path)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--top", type=int, default=12, help="sites listed (default 12)")
    a = p.parse_args(argv)
    try:
        print(json.dumps(analyse(load(a.snapshot), a.device, a.top), indent=1))
    except (OSError, pickle.UnpicklingError, ValueError, KeyError) as e:
        print(f"{a.snapshot}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
