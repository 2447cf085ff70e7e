"""megatron-core's ColumnParallelLinear + RowParallelLinear built with
``gradient_accumulation_fusion=True`` and trained, with apex not installed.

    python examples/apex_free_fusion.py            # CUDA if available, else CPU
    python examples/apex_free_fusion.py --json     # last line: the report as JSON

Without gemm_patch the first constructor raises megatron's "fused_weight_gradient_mlp_cuda
module is not found". With it, apex's two wgrad kernels are provided through gemm_patch's
dispatcher; the weights are ordinary (non-FSDP) parameters with an fp32 ``main_grad``, so every
backward runs ``wgrad_gemm_accum_fp32`` (main_grad += grad_output^T @ input), two micro-batches
per step, then an SGD step from ``main_grad``. Each step also checks ColumnParallelLinear's
main_grad against an fp64 recomputation.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

import gemm_patch  # before or after megatron: either way it patches on import


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, ffn, tokens, batch = args.hidden, 4 * args.hidden, 256, 4

    # A one-process group: tensor-parallel size 1 is all the constructors need.
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    config = ModelParallelConfig(gradient_accumulation_fusion=True, use_cpu_initialization=True,
                                 params_dtype=torch.bfloat16)
    init = torch.nn.init.xavier_normal_
    column = ColumnParallelLinear(hidden, ffn, config=config, init_method=init, bias=False).to(device)
    row = RowParallelLinear(ffn, hidden, config=config, init_method=init, bias=False,
                            input_is_parallel=True, skip_bias_add=False).to(device)
    weights = [column.weight, row.weight]
    for w in weights:
        w.main_grad = torch.zeros(w.shape, device=device)

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, batch, hidden, device=device, generator=gen).to(torch.bfloat16)
    target = torch.randn(tokens, batch, hidden, device=device, generator=gen).to(torch.bfloat16)
    status = gemm_patch.status()
    from gemm_patch.gemm.active import active_dispatcher

    probe = torch.empty(1, 1, device=device, dtype=torch.bfloat16)
    backend = active_dispatcher().plan_for(probe, probe, probe.float(), accumulate=True)[0]
    report = {"device": device, "versions": status.versions, "apex": status.apex,
              "apex_wgrad": status.as_dict()["targets"][1], "backend": backend,
              "fusion": [column.gradient_accumulation_fusion, row.gradient_accumulation_fusion],
              "losses": [], "main_grad_rel_err": []}
    if not args.json:
        print(f"megatron-core {status.versions['megatron-core']} on {device}; apex: {status.apex}; "
              f"wgrad accumulate backend: {backend}")
    for it in range(args.steps):
        for w in weights:
            w.main_grad.zero_()
        expected = torch.zeros(column.weight.shape, dtype=torch.float64, device=device)
        for _ in range(2):  # micro-batches: fusion accumulates both into main_grad
            h, _ = column(x)
            h.retain_grad()
            y, _ = row(torch.nn.functional.gelu(h))
            loss = torch.nn.functional.mse_loss(y.float(), target.float())
            loss.backward()
            expected += h.grad.reshape(-1, ffn).double().t() @ x.reshape(-1, hidden).double()
        rel = ((column.weight.main_grad.double() - expected).norm() / expected.norm()).item()
        report["losses"].append(loss.item())
        report["main_grad_rel_err"].append(rel)
        if not args.json:
            print(f"step {it}: loss {loss.item():.5f}  column main_grad vs fp64: {rel:.1e}  "
                  f"weight.grad: {column.weight.grad}")
        with torch.no_grad():
            for w in weights:
                w -= 2.0 * w.main_grad.to(w.dtype)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if args.json:
        print(json.dumps(report))
    ok = report["losses"][-1] < report["losses"][0] and max(report["main_grad_rel_err"]) < 1e-5
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
