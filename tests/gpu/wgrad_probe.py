"""Run megatron-core's real FSDP wgrad path on the GPU for a set of cases and print, per case,
a bitwise fingerprint of main_grad, its relative error against fp64 and whether NaN poison is
left. Used by tests/gpu to compare releases and backends across interpreters (two
megatron-core releases cannot share one).

    python tests/gpu/wgrad_probe.py --cases standard --json out.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch

SHAPES = {  # (tokens, in_features, out_features)
    "standard": [(2048, 1024, 1024), (8192, 4096, 4096), (4096, 4096, 128256)],
    "small": [(256, 512, 384)],
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bit_fingerprint(t: torch.Tensor) -> list[int]:
    """Three int64 sums over the raw bits (NaNs canonicalised): equal lists mean equal tensors
    for any practical purpose, without copying gigabytes to the host."""
    bits = t.contiguous().view(torch.int32).to(torch.int64)
    bits = torch.where(torch.isnan(t).reshape(bits.shape), torch.full_like(bits, 0x7FC00000), bits)
    flat = bits.flatten()
    pos = torch.arange(flat.numel(), device=t.device, dtype=torch.int64) % 1000003 + 1
    return [int(flat.sum()), int((flat * pos).sum()), int((flat ^ (flat >> 7)).sum())]


def make_inputs(tokens, k, n, dtype, seed, special):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, k, device="cuda", generator=gen).to(dtype)
    grad = torch.randn(tokens, n, device="cuda", generator=gen).to(dtype)
    w = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
    if special == "nan":
        x[5, 7] = float("nan")
    elif special == "inf":
        grad[3, 2] = float("inf")
    return x, grad, w


def run_case(layers, tokens, k, n, dtype, seed=0, special=None) -> dict:
    x, grad, w_data = make_inputs(tokens, k, n, dtype, seed, special)
    x.requires_grad_()
    weight = torch.nn.Parameter(w_data)
    main_grad = torch.full((n, k), float("nan"), device="cuda", dtype=torch.float32)
    weight.__fsdp_param__ = True  # Megatron-FSDP's parameter contract, as the layer reads it
    weight.main_grad = main_grad
    weight.get_main_grad = lambda: main_grad
    y = layers.linear_with_grad_accumulation_and_async_allreduce(
        x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False)
    y.backward(grad)
    torch.cuda.synchronize()
    out = {"shape": [tokens, k, n], "dtype": str(dtype).removeprefix("torch."), "special": special,
           "bits": bit_fingerprint(main_grad), "nan_count": int(torch.isnan(main_grad).sum()),
           "inf_count": int(torch.isinf(main_grad).sum())}
    if special is None:
        ref = grad.double().t() @ x.detach().double()
        out["rel_err"] = float((main_grad.double() - ref).norm() / ref.norm())
        del ref
    del x, grad, weight, y
    torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="standard", choices=sorted(SHAPES))
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    if os.environ.get("GEMM_PATCH", "1") != "0":
        import gemm_patch  # noqa: F401  (applies the patch)
    import megatron.core.tensor_parallel.layers as layers

    results = []
    for tokens, k, n in SHAPES[args.cases]:
        for dtype in DTYPES.values():
            results.append(run_case(layers, tokens, k, n, dtype))
    for special in ("nan", "inf"):
        results.append(run_case(layers, 512, 256, 384, torch.bfloat16, special=special))
    info = {"cases": results, "mcore": None, "gemm_patch": None}
    from megatron.core import package_info

    info["mcore"] = package_info.__version__
    if "gemm_patch" in __import__("sys").modules:
        import gemm_patch

        info["gemm_patch"] = gemm_patch.status().as_dict()
    with open(args.json, "w") as fh:
        json.dump(info, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
