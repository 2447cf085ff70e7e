"""Host time of each gemm-patch fix on the path of a training step, per call (CPU, medians), and
the GPU work each fix adds or saves per micro-batch at the size of the pretrain_gpt measurement.

Per call, with a megatron-core release on the path (compat/matrix.py's ``release_env``):

  * fsdp-wgrad: megatron's fused linear, forward and backward through its own autograd function
    on a Megatron-FSDP parameter with a persistent bf16 main_grad (where the original's
    ``torch.matmul(out=)`` works), the twin (its GEMM made the original's) against the original;
    and ``wgrad_accumulates`` alone (the dispatcher's own cost: benchmarks/overhead.py);
  * fsdp-shared-grad: the two calls the ``_grad_acc`` twin adds (``restore_written_flag``,
    ``add_shared_grad`` for a weight that is not ``zero_out_wgrad``);
  * fsdp-te-overwrite: the wrapper of ``all_gather_and_wait_parameters_ready`` around a method
    that does nothing, for an FSDP unit of 8 parameters, against the bare method;
  * the tied weight's zeros dummy: ``broadcast_zero`` against megatron's ``torch.zeros`` at a small
    shape (the host side; the GPU side is in the table below).

    compat/.cache/venv-3.12/bin/python -m benchmarks.hook_overhead [--json out.json]
    (with PYTHONPATH=compat/isolate:compat/.cache/mcore-0.19.2-py3.12:.)

The GPU table is arithmetic, not a measurement: bytes each fix reads or writes in HBM per
micro-batch at hidden 4096, vocabulary 128256, FFN 16384, 4 layers, fp32 main grads, bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import timeit
import types

NUMBER, REPEAT, ROUNDS = 2000, 7, 5


def per_call_us(fn, number: int = NUMBER) -> float:
    return min(timeit.repeat(fn, number=number, repeat=REPEAT)) / number * 1e6


def interleaved(cases: dict, number: int = NUMBER) -> dict[str, float]:
    """Median over rounds of each case's best per-call time; the cases alternate within a round."""
    rows: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(ROUNDS):
        for name, fn in cases.items():
            rows[name].append(per_call_us(fn, number))
    return {k: statistics.median(v) for k, v in rows.items()}


def fsdp_param(torch, shape, persistent: bool = True):
    weight = torch.nn.Parameter(torch.randn(*shape).to(torch.bfloat16))
    gbuf = types.SimpleNamespace(is_data_distributed=not persistent)
    main_grad = torch.zeros(shape, dtype=torch.bfloat16)
    weight.__fsdp_param__ = True
    weight._gbuf = gbuf
    weight.grad_added_to_main_grad = False
    weight.main_grad = main_grad
    weight.get_main_grad = lambda: main_grad
    return weight


def fused_linear_cost(torch) -> dict[str, float]:
    """Forward + backward of megatron's fused linear, twin and original, per call."""
    from megatron.core.tensor_parallel import layers

    import gemm_patch
    from gemm_patch.targets import fsdp_wgrad

    torch.cuda.current_device = lambda: "cpu"  # megatron's no-TE dummy is allocated there
    weight = fsdp_param(torch, (16, 16))
    x = torch.randn(8, 16).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(8, 16).to(torch.bfloat16)

    def step():
        y = layers.linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False)
        y.backward(grad)
        weight.grad = None
        weight.grad_added_to_main_grad = False
        x.grad = None

    cls = layers.LinearWithGradAccumulationAndAsyncCommunication
    gemm_patch.apply()
    # The twin's GEMM made the original's (an overwrite by torch.matmul): what is left is the
    # twin's own host work (wgrad_accumulates, the dummy's view, the redirection). On the CPU the
    # dispatcher's add would otherwise run the exact fallback, which is not host overhead.
    same_gemm = types.SimpleNamespace(gemm=lambda a, b, out, accumulate: torch.matmul(a, b, out=out))
    fsdp_wgrad._active_dispatcher = lambda: same_gemm
    patched = vars(cls)["backward"]
    if not hasattr(patched, "__wrapped__"):
        raise SystemExit("fsdp-wgrad is not patched on this release")
    original = patched.__wrapped__

    def with_backward(obj):
        def run():
            type.__setattr__(cls, "backward", obj)
            try:
                step()
            finally:
                type.__setattr__(cls, "backward", patched)
        return run

    gemm_patch.revert()
    os.environ["GEMM_PATCH_FSDP_DUMMY_GRAD"] = "0"
    gemm_patch.apply()
    megatrons_dummy = vars(cls)["backward"]
    del os.environ["GEMM_PATCH_FSDP_DUMMY_GRAD"]
    gemm_patch.revert()
    gemm_patch.apply()
    patched = vars(cls)["backward"]

    number = 500
    times = interleaved({"original": with_backward(original), "twin": with_backward(patched),
                         "twin, megatron's dummy": with_backward(megatrons_dummy)}, number)
    return {**times, "twin above the original": times["twin"] - times["original"],
            "of which the dummy's view of main_grad": times["twin"] - times["twin, megatron's dummy"]}


def rule_costs(torch) -> dict[str, float]:
    from gemm_patch.targets import shared_grad
    from gemm_patch.upstream import fsdp_rules

    persistent, fresh = fsdp_param(torch, (4, 4)), fsdp_param(torch, (4, 4), persistent=False)

    def restore_after_write():
        fsdp_rules.wgrad_accumulates(fresh)
        fsdp_rules.restore_written_flag(fresh)

    times = interleaved({
        "wgrad_accumulates (persistent)": lambda: fsdp_rules.wgrad_accumulates(persistent),
        "wgrad_accumulates (fresh bucket)": lambda: fsdp_rules.wgrad_accumulates(fresh),
        "restore_written_flag (no record)": lambda: fsdp_rules.restore_written_flag(persistent),
        "wgrad_accumulates + restore_written_flag": restore_after_write,
        "add_shared_grad (not zero_out_wgrad)": lambda: shared_grad.add_shared_grad(persistent, lambda t: t),
    }, number=20000)
    times["restore_written_flag (after a write)"] = (times.pop("wgrad_accumulates + restore_written_flag")
                                                     - times["wgrad_accumulates (fresh bucket)"])
    return times


def te_overwrite_cost(torch) -> dict[str, float]:
    from gemm_patch.targets.te_overwrite import PatchedOverwriteFlag

    params = [fsdp_param(torch, (4, 4)) for _ in range(8)]

    class Unit:  # Megatron-FSDP's unshard sets the flag on every parameter it is given
        def all_gather_and_wait_parameters_ready(self, params, **kwargs):
            for p in params:
                p.overwrite_main_grad = True

    class PatchedUnit(Unit):
        all_gather_and_wait_parameters_ready = PatchedOverwriteFlag(Unit.all_gather_and_wait_parameters_ready)

    bare, patched = Unit(), PatchedUnit()
    times = interleaved({"bare method (8 params)": lambda: bare.all_gather_and_wait_parameters_ready(params),
                         "wrapped (8 params)": lambda: patched.all_gather_and_wait_parameters_ready(params)},
                        number=20000)
    return {**times, "wrapper above the method": times["wrapped (8 params)"] - times["bare method (8 params)"]}


def zero_dummy_cost(torch) -> dict[str, float]:
    """Timed where megatron asks for the dummy: inside a backward that accumulates into the
    weight's ``.grad`` (the zeros are given only there)."""
    from gemm_patch.targets.fsdp_wgrad import broadcast_zero

    weight = fsdp_param(torch, (64, 32))
    times: dict[str, float] = {}

    class Use(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            return w.clone()

        @staticmethod
        def backward(ctx, grad):
            assert broadcast_zero(weight, [64, 32], torch.bfloat16) is not None
            times.update(interleaved({
                "megatron's torch.zeros (64 x 32 bf16)": lambda: torch.zeros((64, 32), dtype=torch.bfloat16),
                "broadcast_zero (64 x 32 bf16)": lambda: broadcast_zero(weight, [64, 32], torch.bfloat16),
            }, number=20000))
            return grad

    Use.apply(weight).float().sum().backward()
    weight.grad = None
    return times


def gpu_bytes() -> list[dict]:
    """HBM bytes per micro-batch each fix adds (+) or saves (-) against upstream's fused path, at
    the pretrain_gpt size; upstream's own behaviour there loses these gradients."""
    vocab, hidden, ffn, layers_ = 128256, 4096, 16384, 4
    te_weights = layers_ * (hidden * 3 * hidden + hidden * hidden + hidden * ffn + ffn * hidden)
    output = vocab * hidden
    gb = 1e9
    return [
        {"fix": "fsdp-wgrad (output layer adds into its persistent fp32 main_grad)",
         "work": "GEMM epilogue reads C", "bytes": output * 4, "gb": output * 4 / gb},
        {"fix": "fsdp-te-overwrite (TE layers add into theirs)",
         "work": "GEMM epilogues read C", "bytes": te_weights * 4, "gb": te_weights * 4 / gb},
        {"fix": "fsdp-shared-grad (embedding gradient added into main_grad)",
         "work": "read bf16 param.grad + read/write fp32 main_grad", "bytes": output * (2 + 4 + 4),
         "gb": output * 10 / gb},
        {"fix": "zeros dummy: one broadcast zero instead of TE's cached tensor",
         "work": "no fill_(0) of the dummy, the engine's sum reads no dummy", "bytes": -output * 2 * 2,
         "gb": -output * 4 / gb},
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch
    from megatron.core import package_info

    torch.set_num_threads(1)
    result = {"megatron_core": package_info.__version__, "torch": torch.__version__,
              "python": sys.version.split()[0], "us_per_call": {
                  "fsdp-wgrad fused linear fwd+bwd": fused_linear_cost(torch),
                  "rules": rule_costs(torch), "fsdp-te-overwrite": te_overwrite_cost(torch),
                  "zeros dummy": zero_dummy_cost(torch)},
              "gpu_bytes_per_micro_batch": gpu_bytes()}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    print(f"megatron-core {result['megatron_core']}, torch {result['torch']}, one CPU thread; medians")
    print("| host, per call | us |\n|---|---|")
    for group, rows in result["us_per_call"].items():
        for name, us in rows.items():
            print(f"| {group}: {name} | {us:.2f} |")
    print("\n| GPU work per micro-batch (arithmetic) | what | GB |\n|---|---|---|")
    for row in result["gpu_bytes_per_micro_batch"]:
        print(f"| {row['fix']} | {row['work']} | {row['gb']:+.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
