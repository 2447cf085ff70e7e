#!/usr/bin/env python
"""Every layout of a weight used once or twice per backward under a release's real Megatron-FSDP
hooks, on the CPU: the harness of tests/megatron/test_shared_weights.py (megatron's real
embedding, output and MTP projection layers, the release's ``_register_fsdp_hooks``, stand-ins
for the buffer and the reduce pipeline), swept over

  hooks (gemm-patch's twin / upstream's with fsdp-wgrad on) x tied / MTP (4) x fresh / persistent
  bucket x strategy x own / shared bucket x reduced buckets kept / freed x activation checkpoint
  of the MTP head (none, reentrant, non-reentrant) x fine-grained parameter gather (where the
  release has it),

each fused run compared per parameter with fp64 autograd and with the same layout under fusion
off. Run with one release on the path (as compat/matrix.py's release_env gives it):

    PYTHONPATH=compat/isolate:compat/.cache/mcore-0.15.3:tests/megatron:. python -m validation.parity.hooks_sweep_cpu

(tests/megatron on the path: the sweep runs that folder's harness, whose modules import each
other by their plain names, as pytest imports them.)

Prints one line per combination that fails (the fused path further from fp64 than
max(tolerance, fusion off + tolerance), NaN, or raising where fusion off runs) and a summary
line that also counts where fusion off itself is off (upstream's) and where both paths raise.
Exit status 1 where a combination under gemm-patch's hooks fails.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every combination's errors here")
    args = parser.parse_args()

    import torch

    torch.cuda.current_device = lambda: "cpu"  # megatron's dummy wgrad without TE
    try:
        import megatron_cpu
    except ImportError:
        raise SystemExit("tests/megatron must be on PYTHONPATH (the harness the sweep runs); see --help") from None
    import test_shared_weights as harness
    from test_fine_grained_gather import has_fine_grained_hook

    import gemm_patch

    gemm_patch.apply()
    rows, failures = [], []
    with megatron_cpu.model_parallel():
        for name, (target, module) in harness.MODULES.items():
            if harness.expected_state(target) not in harness.PATCHED:
                continue
            patched = vars(module.MegatronFSDP)[harness.ATTR]
            upstream = getattr(patched, "__wrapped__", None)
            fine_options = (False, True) if has_fine_grained_hook(module) else (False,)
            for hooks, (tied, mtp), distributed, buckets, keep, fine in itertools.product(
                    ("twin", "upstream"), [c.values for c in harness.CASES], (True, False), harness.BUCKETS,
                    (None, 0), fine_options):
                strategies = (("optim_grads", "optim_grads_params") if distributed
                              else ("no_shard", "optim_grads_params"))
                if fine:
                    strategies = ("optim_grads_params",)
                for strategy, checkpoint in itertools.product(
                        strategies, harness.TiedLM.CHECKPOINTS if mtp else ("none",)):
                    if hooks == "upstream" and upstream is None:
                        continue
                    case = dict(target=name, hooks=hooks, tied=tied, mtp=mtp, fresh=distributed, strategy=strategy,
                                buckets=buckets, keep="all" if keep is None else keep, checkpoint=checkpoint,
                                fine_grained=fine)
                    kwargs = dict(tied=tied, mtp=mtp, distributed=distributed, strategy=strategy, buckets=buckets,
                                  keep=keep, checkpoint=checkpoint, fine_grained=fine, micro_batches=2,
                                  upstream_failure_skips=False)
                    row = dict(case)
                    for config, fusion in (("fused", True), ("fusion_off", False)):
                        setattr(module.MegatronFSDP, harness.ATTR, patched if hooks == "twin" else upstream)
                        try:
                            _, got, ref, _ = harness.train(module, fusion=fusion, **kwargs)
                        except Exception as exc:  # an upstream failure is a result too
                            row[config] = f"{type(exc).__name__}: {exc}"[:200]
                        else:
                            row[config] = {n: harness.rel(got[n], ref[n]) for n in got}
                        finally:
                            setattr(module.MegatronFSDP, harness.ATTR, patched)
                    rows.append(row)
                    fused, off = row["fused"], row["fusion_off"]
                    if isinstance(fused, dict) and isinstance(off, dict):
                        # NaN compares False: a NaN gradient fails here too
                        if not all(fused[n] < max(harness.TOL, off[n] + harness.TOL) for n in fused):
                            failures.append(row)
                    elif isinstance(off, dict):
                        failures.append(row)  # the fused path raised where fusion off ran
    ran = [r for r in rows if isinstance(r["fused"], dict)]
    both_raised = [r for r in rows if not isinstance(r["fused"], dict) and not isinstance(r["fusion_off"], dict)]
    upstream_off = [r for r in ran if isinstance(r["fusion_off"], dict)
                    and any(not e < harness.TOL for e in r["fusion_off"].values())]
    twin = [r for r in ran if r["hooks"] == "twin"]
    worst = max((e for r in twin for e in r["fused"].values()), default=float("nan"))
    for r in failures:
        print("FAIL", json.dumps(r))
    twin_failures = [r for r in failures if r["hooks"] == "twin"]
    print(f"{len(rows)} combinations: fused ran in {len(ran)} ({len(twin)} under gemm-patch's hooks), both "
          f"paths raised in {len(both_raised)}; failing (fused worse than fusion off by > {harness.TOL}, NaN, "
          f"or raised alone): {len(twin_failures)} under gemm-patch's hooks, {len(failures) - len(twin_failures)} "
          f"under upstream's; fusion off itself > {harness.TOL} from fp64 in {len(upstream_off)}; max rel. "
          f"error of the fused path under gemm-patch's hooks {worst:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if twin_failures else 0


if __name__ == "__main__":
    sys.exit(main())
