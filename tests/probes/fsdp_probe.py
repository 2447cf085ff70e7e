"""Run in a child process by the launcher and auto-switch tests; never imports gemm_patch.

It reports, as JSON, whether gemm_patch was already loaded when the script started (so a
start-up hook did it), whether megatron-core's call site is the patched one, and the result
of megatron-core's real FSDP wgrad path with an fp32 main_grad against fp64.

    python fsdp_probe.py OUT.json            one process
    python fsdp_probe.py --spawn OUT_DIR     the same in 2 multiprocessing 'spawn' workers
    torchrun ... fsdp_probe.py --dist OUT_DIR   one report per rank, plus a gloo all-reduce
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

LOADED_AT_START = "gemm_patch" in sys.modules


def make_inputs(seed: int, torch):
    """Activations, weight and output gradient (bf16) of rank/worker ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    weight = torch.randn(80, 64, generator=gen).to(torch.bfloat16)
    grad_out = torch.randn(96, 80, generator=gen).to(torch.bfloat16)
    return x, weight, grad_out


def fsdp_reference(seed: int, torch):
    x, _, grad_out = make_inputs(seed, torch)
    return grad_out.double().t() @ x.double()


def fsdp_step(seed: int):
    """One forward/backward through megatron-core's fused-wgrad linear, with a weight that
    follows Megatron-FSDP's contract (``__fsdp_param__``, ``get_main_grad()``) and an fp32,
    NaN-poisoned main_grad. Returns (main_grad or None, error text)."""
    import megatron.core.tensor_parallel.layers as layers
    import torch

    x, weight, grad_out = make_inputs(seed, torch)
    x.requires_grad_()
    weight = torch.nn.Parameter(weight)
    main_grad = torch.full((80, 64), float("nan"), dtype=torch.float32)
    weight.__fsdp_param__ = True
    weight.main_grad = main_grad
    weight.get_main_grad = lambda: main_grad
    try:
        y = layers.linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False,
            sequence_parallel=False,
        )
        y.backward(grad_out)
    except RuntimeError as exc:  # the unpatched crash: fp32 out from bf16 operands
        return None, str(exc).splitlines()[0]
    return main_grad, None


def _rel(got, reference) -> float:
    return ((got.double() - reference).norm() / reference.norm()).item()


def report(seed: int = 0) -> dict:
    import megatron.core.tensor_parallel.layers as layers
    import torch

    backward = vars(layers.LinearWithGradAccumulationAndAsyncCommunication)["backward"]
    main_grad, error = fsdp_step(seed)
    reference = fsdp_reference(seed, torch)
    return {
        "pid": os.getpid(),
        "gemm_patch_loaded_at_start": LOADED_AT_START,
        "call_site": type(backward).__name__,
        "error": error,
        "rel_error": None if main_grad is None else _rel(main_grad, reference),
        "nan_left": None if main_grad is None else bool(torch.isnan(main_grad).any()),
        "main_grad": main_grad,
    }


def _spawn_worker(seed: int) -> dict:
    out = report(seed)
    out.pop("main_grad")
    return out


def main(argv: list[str]) -> None:
    if argv[0] == "--spawn":
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(2) as pool:
            results = pool.map(_spawn_worker, [0, 1])
        Path(argv[1], "spawn.json").write_text(json.dumps({"parent_pid": os.getpid(), "workers": results}))
    elif argv[0] == "--dist":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        out = report(seed=rank)
        main_grad = out.pop("main_grad")
        if main_grad is not None:
            # The data-parallel reduction Megatron-FSDP does next: sum the fp32 main grads.
            summed = main_grad.clone()
            dist.all_reduce(summed)
            expected = sum(fsdp_reference(seed, torch) for seed in range(world))
            out["allreduce_rel_error"] = _rel(summed, expected)
        out.update(rank=rank, world_size=world, backend=dist.get_backend())
        # Without this barrier one rank can tear gloo down while its peer's last send is in
        # flight, which aborts the peer ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()
        Path(argv[1], f"rank{rank}.json").write_text(json.dumps(out))
        # torch 2.13's gloo threads sometimes abort at interpreter teardown ("terminate called
        # without an active exception", about 1 run in 15 on 2 cores) after all work is done;
        # leave without teardown so the exit status reflects this probe, not that.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        out = report()
        out.pop("main_grad")
        Path(argv[0]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
