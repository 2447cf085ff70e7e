"""``gemm-patch demo``: the crash and the fix on megatron-core's real FSDP wgrad path."""

from __future__ import annotations

import io
import sys


def _fsdp_step(layers, torch, main_dtype, device, tokens=512, hidden=1024, out_features=2048, seed=0):
    """One forward/backward through megatron-core's fused-wgrad linear with a weight that
    follows Megatron-FSDP's parameter contract (``__fsdp_param__``, ``get_main_grad()``)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(out_features, hidden, generator=gen).to(device, torch.bfloat16))
    main_grad = torch.full((out_features, hidden), float("nan"), dtype=main_dtype, device=device)
    weight.__fsdp_param__ = True
    weight.main_grad = main_grad
    weight.get_main_grad = lambda: main_grad
    y = layers.linear_with_grad_accumulation_and_async_allreduce(
        x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False
    )
    grad_out = torch.randn(y.shape, generator=gen).to(device, torch.bfloat16)
    y.backward(grad_out)
    reference = grad_out.double().t() @ x.detach().double()
    rel = ((main_grad.double() - reference).norm() / reference.norm()).item()
    return rel, bool(torch.isnan(main_grad).any())


def main(out: io.TextIOBase = sys.stdout) -> int:
    import gemm_patch

    try:
        import megatron.core.tensor_parallel.layers as layers
        import torch
    except ImportError as exc:
        print(f"demo needs torch and megatron-core importable: {exc}", file=out)
        return 2
    from .dispatcher import active_dispatcher

    device = "cuda" if torch.cuda.is_available() else "cpu"
    st = gemm_patch.status()
    print(f"megatron-core {st.versions['megatron-core']}, torch {torch.__version__}, device {device}", file=out)
    print("shape: tokens 512, hidden 1024 -> 2048, bf16 activations\n", file=out)

    gemm_patch.revert()
    try:
        _fsdp_step(layers, torch, torch.float32, device)
        print("unpatched, fp32 main_grad: no error (this release does not need the patch here)", file=out)
    except RuntimeError as exc:
        print(f"unpatched, fp32 main_grad: RuntimeError: {exc}", file=out)
    finally:
        status = gemm_patch.apply()
    target = status.targets[0]
    print(f"patched: fsdp-wgrad {target.state} ({target.reason})\n", file=out)
    if target.state not in ("verified", "unverified"):
        return 1

    dispatcher = active_dispatcher()
    probe = torch.empty(1, 1, dtype=torch.bfloat16, device=device)
    fp32_backend = dispatcher.plan_for(probe, probe, probe.float())[0]
    rows = [("fp32 (gemm_patch)", fp32_backend, *_fsdp_step(layers, torch, torch.float32, device)),
            ("bf16 (original call)", "torch.matmul", *_fsdp_step(layers, torch, torch.bfloat16, device))]
    print("| main_grad            | backend      | rel. error vs fp64 | NaN left |", file=out)
    print("|----------------------|--------------|--------------------|----------|", file=out)
    for name, backend, rel, nan_left in rows:
        print(f"| {name:<20} | {backend:<12} | {rel:>18.2e} | {'yes' if nan_left else 'no':<8} |", file=out)
    return 0 if rows[0][2] < 1e-5 and not rows[0][3] else 1
