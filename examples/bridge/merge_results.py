#!/usr/bin/env python
"""Merge run_bridge.py's per-pairing JSONs into examples/results/bridge.json.

    python examples/bridge/merge_results.py FILES_AT/bridge_0.6.2.json [FILES_AT/bridge_0.4.2.json]

The first file's fields are the top level (``bridge_version``, ``megatron_core``,
``unpatched_outcome``, ``patched``, ``grad_parity``, ``bridge_tests``, ...); every file, the first
included, is also kept whole under ``pairings``, keyed ``bridge X + megatron-core Y``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "results" / "bridge.json"


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__)
        return 2
    runs = [json.loads(Path(p).read_text()) for p in paths]
    merged = dict(runs[0])
    merged["pairings"] = {f"bridge {r.get('bridge_version')} + megatron-core {r.get('megatron_core')}": r for r in runs}
    merged["how"] = ("examples/bridge/run_bridge.py on 2 x H200 (TE from ../shared/device kit); "
                     "see examples/bridge/README.md")
    OUT.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    for r in runs:
        gp, bt = r.get("grad_parity") or {}, r.get("bridge_tests") or {}
        pt = r.get("patched") or {}
        head = f"{r.get('bridge_version')} + {r.get('megatron_core')}"
        print(f"{head}: unpatched: {str(r.get('unpatched_outcome'))[:160]}")
        print(f"  patched losses {pt.get('losses')} median {pt.get('median_step_ms')} ms")
        print(f"  grad parity {gp.get('passed')} ({gp.get('params')} params, max rel {gp.get('max_rel_diff')})")
        u = bt.get("unpatched") or {}
        print(f"  tests patched {bt.get('passed')}/{bt.get('failed')}/{bt.get('skipped')} "
              f"unpatched {u.get('passed')}/{u.get('failed')}/{u.get('skipped')} (passed/failed/skipped)")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
