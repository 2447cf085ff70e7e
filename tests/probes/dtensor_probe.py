"""Run under torchrun (gloo, CPU): a module whose parameter is a DTensor sharded unevenly over the
ranks, with a DTensor gradient, as Megatron-FSDP leaves them after ``finish_grad_sync``; writes one
JSON file per rank into the folder given as its argument (ranks sharing one stdout pipe can cut each
other's lines): the gradient probe's record of it and the expected values of the whole gradient."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from gemm_patch.engine import grad_probe


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(7)
    whole = torch.randn(7, 5, generator=gen, dtype=torch.float32)  # 7 rows over 2 ranks: 4 and 3
    module = torch.nn.Linear(5, 7, bias=False)
    module.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(7, 5), mesh, [Shard(0)]))
    module.weight.grad = distribute_tensor(whole, mesh, [Shard(0)])
    rec = grad_probe.record([module])
    expected = grad_probe.contribution(whole.reshape(-1), 0).tolist()
    rank = dist.get_rank()
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "record": rec, "expected": expected, "local_rows": module.weight.grad.to_local().shape[0]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
