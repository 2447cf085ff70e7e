"""benchmarks/memory_peak.py on a snapshot in the form torch's ``_snapshot()`` gives (segments with
their blocks, the allocator's events), the peak inside the window and blocks of before it."""

from __future__ import annotations

import pickle

import pytest

from benchmarks import memory_peak

MIB = 1024 * 1024


def frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


PARAM = [frame("/usr/lib/python3/site-packages/torch/nn/parameter.py", 40, "__new__"),
         frame("/tmp/gp/mc0192/megatron/core/distributed/fsdp/param_and_grad_buffer.py", 10, "allocate")]
LOGITS = [frame("/tmp/gp/mc0192/megatron/core/tensor_parallel/cross_entropy.py", 51, "forward")]
ROWS = [frame("/work/gemm_patch/targets/embedding_wgrad.py", 99, "write_rows")]


def snapshot() -> dict:
    """A (100 MiB, megatron's buffer) alive throughout; B (50 MiB) allocated before the window,
    freed after the peak; in the window C (30, gemm_patch's), D (200, the logits: the peak) and,
    after D is freed, E (10)."""
    a, b, c, d, e = 0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000, 0x5000_0000
    events = [("alloc", c, 30, ROWS), ("alloc", d, 200, LOGITS), ("free_completed", c, 30, ROWS),
              ("free_requested", b, 50, []), ("free_completed", b, 50, []), ("free_completed", d, 200, LOGITS),
              ("alloc", e, 10, LOGITS)]
    return {
        "segments": [{"device": 0, "address": a, "total_size": 100 * MIB, "blocks": [
                         {"address": a, "size": 100 * MIB, "state": "active_allocated", "frames": PARAM}]},
                     {"device": 0, "address": e, "total_size": 20 * MIB, "blocks": [
                         {"address": e, "size": 10 * MIB, "state": "active_allocated", "frames": LOGITS},
                         {"address": e + 10 * MIB, "size": 10 * MIB, "state": "inactive"}]}],
        "device_traces": [[{"action": act, "addr": addr, "size": size * MIB, "stream": 0, "frames": frames}
                           for act, addr, size, frames in events]],
    }


def test_the_peak_and_what_is_alive_there(tmp_path):
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot()))
    got = memory_peak.analyse(memory_peak.load(path))
    assert got["peak_gib"] == round(380 / 1024, 4) and got["window_start_gib"] == round(150 / 1024, 4)
    assert got["end_gib"] == round(110 / 1024, 4) and got["events"] == 6
    assert got["peak_event"]["site"] == "megatron/core/tensor_parallel/cross_entropy.py:51 forward"
    alive = {g["site"]: g["mib"] for g in got["alive"]}
    assert alive == {"megatron/core/tensor_parallel/cross_entropy.py:51 forward": 200,
                     "megatron/core/distributed/fsdp/param_and_grad_buffer.py:10 allocate": 100,
                     memory_peak.UNKNOWN: 50, "gemm_patch/targets/embedding_wgrad.py:99 write_rows": 30}
    assert got["gemm_patch_mib"] == 30
    assert got["gemm_patch_sites"] == {"gemm_patch/targets/embedding_wgrad.py:99 write_rows": 30}


def test_the_peak_table_names_the_peak_and_gemm_patch_share(tmp_path):
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot()))
    peak = memory_peak.analyse(memory_peak.load(path))
    run = {"size": "llama3.2-1b", "release": "0.19.2", "tied": True, "device": "NVIDIA H200", "rc": 0}
    quiet = {**peak, "gemm_patch_mib": 0.0, "gemm_patch_sites": {}}
    records = [{**run, "config": "patched", "memory_peak": peak},
               {**run, "config": "fusion_off", "memory_peak": quiet},
               {**run, "config": "fusion_off", "rc": 1, "memory_peak": None}]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in memory_peak.peak_table(records).splitlines()[2:]]
    assert [r[1] for r in rows] == ["patched", "fusion_off"]  # the failed run has no row
    patched, off = rows
    assert patched[:4] == ["llama3.2-1b, 0.19.2, tied", "patched", "NVIDIA H200", f"{380 / 1024:.2f}"]
    assert patched[4] == "cross_entropy.py:51 forward"
    assert patched[5] == "cross_entropy.py:51 forward 200; param_and_grad_buffer.py:10 allocate 100; " + \
        f"{memory_peak.UNKNOWN} 50"
    assert patched[6] == "30 (embedding_wgrad.py:99 write_rows 30)" and off[6] == "0"


def test_a_snapshot_without_history_says_so():
    bare = snapshot()
    bare["device_traces"] = [[]]
    with pytest.raises(ValueError, match="--record-memory-history"):
        memory_peak.analyse(bare)
