"""Does an NCCL collective apply a PreMulSum factor over a one-rank group? (the ep2_moe layout)

    torchrun --standalone --nproc-per-node 2 -m validation.probes.premul_one_rank OUT_DIR

Each rank reduces a tensor of 2.0s with ``torch.distributed._make_nccl_premul_sum(0.5)`` (the op
Megatron-FSDP's ``gradient_reduce_preprocessing`` builds with gradient_reduce_div_fusion) over
its own one-rank group and over both ranks: reduce-scatter in place (how Megatron-FSDP calls it
on an unsharded buffer), reduce-scatter out of place, and all-reduce. Expected: 0.5 x 2.0 x ranks.
Rank 0 writes OUT_DIR/premul_pin.json. Measured on 2 x H200 (torch 2.11.0+cu130, NCCL 2.28.9,
2026-11-30): the one-rank reduce-scatters return 2.0 (factor dropped), everything else is right;
validation/results/premul_one_rank_h200.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def reduce(case: str, group, ranks: int, rank: int) -> float:
    x = torch.full((8 * ranks,), 2.0, device="cuda")
    op = dist._make_nccl_premul_sum(0.5)
    if case == "rs_inplace":
        out = x.view(ranks, 8)[rank if ranks > 1 else 0]
        dist.reduce_scatter_tensor(out, x, op=op, group=group)
    elif case == "rs_out_of_place":
        out = torch.empty(8, device="cuda")
        dist.reduce_scatter_tensor(out, x, op=op, group=group)
    else:
        dist.all_reduce(x, op=op, group=group)
        out = x
    torch.cuda.synchronize()
    return out[0].item()


def main() -> int:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))  # 0 for every rank sharing one GPU
    own = [dist.new_group([i]) for i in range(dist.get_world_size())][rank]
    result = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    for name, group, ranks in (("one_rank", own, 1), ("all_ranks", dist.group.WORLD, dist.get_world_size())):
        for case in ("rs_inplace", "rs_out_of_place", "allreduce"):
            result[f"{name}.{case}"] = {"got": reduce(case, group, ranks, rank), "expected": 0.5 * 2.0 * ranks}
    if rank == 0:
        print(json.dumps(result, indent=1))
        with open(os.path.join(sys.argv[1], "premul_pin.json"), "w") as handle:
            json.dump(result, handle, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
