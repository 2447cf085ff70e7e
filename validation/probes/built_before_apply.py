#!/usr/bin/env python
"""Megatron-LM's own pretrain_gpt.py with its Megatron-FSDP model built before fsdp-shared-grad
is applied: what ``import gemm_patch`` after the model is built does to a tied embedding.

    cd validation/convergence/_upstream/RELEASE     # pretrain_gpt.py and its neighbours
    PYTHONPATH=KIT/mcXYZ:KIT/site:CHECKOUT NCCL_NVLS_ENABLE=0 \\
        python -m torch.distributed.run --standalone --nproc-per-node 1 \\
        CHECKOUT/validation/probes/built_before_apply.py [--order before|after] -- ARGS...

ARGS are pretrain_gpt.py's (benchmarks/pretrain_gpt_bench.py --dry prints them for a tied cell;
keep gradient-accumulation fusion on). The process imports gemm_patch first with
``GEMM_PATCH_DISABLE=fsdp-shared-grad``, so that apex's stand-in and fsdp-wgrad are in place while
megatron validates its arguments and builds the layers (as with apex installed), and runs
pretrain_gpt.py in this process with megatron's ``setup_model_and_optimizer`` wrapped (it builds the
model whether or not through ``get_model``). ``--order before`` (the
default): when it returns (the MegatronFSDP built, its hooks registered), the variable
is dropped and ``gemm_patch.revert()``, ``gemm_patch.apply()`` install fsdp-shared-grad after the
model. ``--order after``: the same before it runs (the usual order, the reference).

Rank 0 prints ``built-before-apply: {json}`` with fsdp-shared-grad's state and reason right
after that apply() and again when training ends. Expected with ``before``: ``verified`` both times
and no WARNING (``apply()`` brings the instance under the patch), and megatron's iteration-1 grad
norm equal to the ``after`` run's (gemm-patch 0.5.0: ``bypassed``, one WARNING, the embedding
lookup's gradient dropped and the grad norm 1.5% off); with ``after``: ``verified``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import sys

TARGET = "fsdp-shared-grad"


def report(when: str) -> None:
    import gemm_patch

    if os.environ.get("RANK", "0") != "0":
        return
    st = {t.name: t for t in gemm_patch.status().targets}[TARGET]
    print("built-before-apply: " + json.dumps({"when": when, "target": TARGET, "state": st.state,
                                                "reason": st.reason}), flush=True)


def apply_everything() -> None:
    import gemm_patch

    os.environ.pop("GEMM_PATCH_DISABLE", None)
    gemm_patch.revert()
    gemm_patch.apply()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--order", choices=("before", "after"), default="before",
                        help="the model built before fsdp-shared-grad is applied (default), or after")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- pretrain_gpt.py's arguments")
    opts = parser.parse_args()
    args = opts.args[1:] if opts.args[:1] == ["--"] else opts.args
    if not os.path.isfile("pretrain_gpt.py") or os.getcwd() not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        raise SystemExit("run this in the folder that holds Megatron-LM's pretrain_gpt.py, with that folder on "
                         "PYTHONPATH (pretrain_gpt.py's neighbours, as `python pretrain_gpt.py` has them)")

    os.environ["GEMM_PATCH_DISABLE"] = TARGET
    import gemm_patch  # noqa: F401  (applies everything but fsdp-shared-grad)

    training = importlib.import_module("megatron.training.training")  # after gemm_patch, as with apex

    setup = training.setup_model_and_optimizer

    def setup_then_apply(*a, **kw):
        if opts.order == "after":
            apply_everything()
        built = setup(*a, **kw)
        if opts.order == "before":
            apply_everything()
        report(f"after setup_model_and_optimizer ({opts.order})")
        return built

    training.setup_model_and_optimizer = setup_then_apply
    sys.argv = ["pretrain_gpt.py", *args]
    runpy.run_path("pretrain_gpt.py", run_name="__main__")
    report("end of training")


if __name__ == "__main__":
    main()
