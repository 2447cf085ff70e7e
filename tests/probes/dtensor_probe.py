"""Run under torchrun (gloo, CPU): modules whose parameter is a DTensor sharded unevenly over the
ranks, with a DTensor gradient, as Megatron-FSDP leaves them after ``finish_grad_sync`` (torch's even
chunks; Megatron-FSDP's own blocks of rows, one rank's possibly empty; a replicated one); writes one
JSON file per rank into the folder given as its argument (ranks sharing one stdout pipe can cut each
other's lines): the gradient probe's record of it, the expected values of this rank's block and the whole's norms."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from gemm_patch.engine import grad_probe


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank, ranks = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    whole = {name: torch.randn(7, 5, generator=gen, dtype=torch.float32) for name in ("even", "empty", "uneven", "rep")}
    # rows per rank (2 ranks): torch's chunks 4/3; Megatron-FSDP's blocks 7/0 and 5/2 (not torch's chunking)
    blocks = {"empty": (7, 0), "uneven": (5, 2)}
    modules = torch.nn.ModuleDict()
    for name, g in whole.items():
        module = modules[name] = torch.nn.Linear(5, 7, bias=False)
        if name in blocks:
            lo = sum(blocks[name][:rank])
            local = g[lo:lo + blocks[name][rank]]
            module.weight = torch.nn.Parameter(DTensor.from_local(torch.zeros_like(local), mesh, [Shard(0)],
                                                                  shape=g.shape, stride=g.stride()))
            module.weight.grad = DTensor.from_local(local.clone(), mesh, [Shard(0)], shape=g.shape, stride=g.stride())
        else:
            placement = [Shard(0)] if name == "even" else [Replicate()]
            module.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(7, 5), mesh, placement))
            module.weight.grad = distribute_tensor(g, mesh, placement)
    rec = grad_probe.record([modules])
    expected = {f"{name}.weight": grad_probe.contribution(modules[name].weight.grad.to_local().reshape(-1), 0).tolist()
                for name in whole}
    whole_norms = {f"{name}.weight": g.double().norm().item() for name, g in whole.items()}
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "ranks": ranks, "record": rec, "expected": expected, "whole_norms": whole_norms,
         "local_rows": {n: modules[n].weight.grad.to_local().shape[0] for n in whole}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
