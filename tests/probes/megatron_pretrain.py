"""A stand-in for Megatron-LM's pretrain_gpt.py on the CPU, built from megatron-core's real pieces:
``ColumnParallelLinear``/``RowParallelLinear`` (bf16, gradient-accumulation fusion as the command
line says), wrapped in megatron's ``DistributedDataParallel`` (fp32 main grads; ``--use-distributed-
optimizer`` reduce-scatters each bucket), ``--micro-batches`` forward/backward passes per step, then
megatron's own ``finalize_model_grads`` (where gemm-patch's gradient probe reads), an SGD update
and megatron's log lines: the argument dump, ``training_log``'s iteration line.

Runs as one process, or one per rank under torchrun (gloo). ``MEGATRON_PRETRAIN_FAULT=lose_scale``
drops the first micro-batch's gradient of four elements of the small ``scale`` parameter in the fused run (what an
overwriting wgrad path does to one parameter), too small a part of the global grad norm to show there;
``keep_scale`` carries ``scale``'s first-step gradient into the second step in the fused run (a main
grad not zeroed between steps: a defect from iteration 2).

``--start-iteration N`` starts the loop at iteration N (a worker restarted from a checkpoint; the
weights here are the initial ones). ``--megatron-args`` sets ``curr_iteration`` of megatron.training's
global arguments before each step, as Megatron-LM's ``train()`` does (megatron.training is
Megatron-LM's, not megatron-core's: a module of that name is made here), where gemm-patch's probe
reads the iteration.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import types

import torch


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--train-iters", type=int, default=3)
    p.add_argument("--start-iteration", type=int, default=1)
    p.add_argument("--megatron-args", action="store_true")
    p.add_argument("--log-interval", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion")
    return p.parse_args(argv)


def init_distributed(tmp: str) -> None:
    import torch.distributed as dist

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)


def build(args: argparse.Namespace) -> torch.nn.Module:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import MegatronModule, TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=1,
                               use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True,
                               gradient_accumulation_fusion=args.gradient_accumulation_fusion)

    class Tiny(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.scale = torch.nn.Parameter(torch.ones(args.hidden, dtype=torch.bfloat16))
            kwargs = dict(config=config, init_method=torch.nn.init.xavier_normal_, bias=False)
            self.fc1 = layers.ColumnParallelLinear(args.hidden, 4 * args.hidden, gather_output=False, **kwargs)
            self.fc2 = layers.RowParallelLinear(4 * args.hidden, args.hidden, input_is_parallel=True,
                                                skip_bias_add=False, **kwargs)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _ = self.fc1(x * self.scale)
            y, _ = self.fc2(torch.nn.functional.gelu(h))
            return y

    torch.manual_seed(1234)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                        use_distributed_optimizer=args.use_distributed_optimizer)
    return DistributedDataParallel(config, ddp, Tiny())


def print_arguments(args: argparse.Namespace) -> None:
    print("------------------------ arguments ------------------------")
    for name, value in sorted(vars(args).items()):
        print(f"  {name} {'.' * (48 - len(name))} {value}")
    print("-------------------- end of arguments ---------------------", flush=True)


def main(argv: list[str]) -> int:
    args = parse(argv)
    torch.cuda.current_device = lambda: "cpu"  # megatron allocates its buffers there
    # 0.19's gradient sync waits on the current CUDA stream's events (none on the CPU)
    torch.cuda.current_stream = lambda *a, **k: types.SimpleNamespace(wait_event=lambda e: None,
                                                                      wait_stream=lambda s: None)
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        init_distributed(tmp)
        from megatron.core import parallel_state
        from megatron.core.distributed import finalize_model_grads

        parallel_state.initialize_model_parallel()
        rank, world = dist.get_rank(), dist.get_world_size()
        if rank == 0:
            print_arguments(args)
        model = build(args)
        lose = os.environ.get("MEGATRON_PRETRAIN_FAULT") == "lose_scale" and args.gradient_accumulation_fusion
        keep = os.environ.get("MEGATRON_PRETRAIN_FAULT") == "keep_scale" and args.gradient_accumulation_fusion
        training_args = types.SimpleNamespace(curr_iteration=None)
        if args.megatron_args:
            sys.modules["megatron.training.global_vars"] = types.SimpleNamespace(_GLOBAL_ARGS=training_args)
        for it in range(args.start_iteration, args.train_iters + 1):
            training_args.curr_iteration = it - 1  # the steps done before this one
            carried = model.module.scale.main_grad.clone() if keep and it == 2 else None
            model.zero_grad_buffer()
            if carried is not None:
                model.module.scale.main_grad.add_(carried)
            total = 0.0
            for m in range(args.micro_batches):
                gen = torch.Generator().manual_seed(1000 * it + 10 * m + rank)
                x = torch.randn(16, 2, args.hidden, generator=gen).to(torch.bfloat16)
                loss = (model(x).float() - 0.1).pow(2).mean() / args.micro_batches
                loss.backward()
                total += loss.item()
                if lose and m == 0:
                    model.module.scale.main_grad[:4].zero_()
            finalize_model_grads([model])
            norm_sq = torch.zeros(1, dtype=torch.float64)
            for param in model.parameters():
                norm_sq += param.main_grad.double().pow(2).sum()
            if args.use_distributed_optimizer:  # each rank holds the reduced shard only: this log line's norm
                norm_sq /= world             # is of the local buffer, as the probe shows per parameter
            for param in model.parameters():
                param.data.add_(param.main_grad.to(param.dtype), alpha=-0.5)
            if rank == world - 1 and (it == 1 or it % args.log_interval == 0):
                print(f" [stand-in] iteration {it:8d}/{args.train_iters:8d} | consumed samples: {it * 2 * world:12d} | "
                      f"elapsed time per iteration (ms): 10.0 | lm loss: {total:.6E} | loss scale: 1.0 | "
                      f"grad norm: {math.sqrt(norm_sq.item()):.3f} | number of skipped iterations:   0 | "
                      f"number of nan iterations:   0 |", flush=True)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
