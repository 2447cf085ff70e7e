"""gemm-patch demo: the crash and the fix on megatron-core's real FSDP wgrad path."""

from __future__ import annotations

import io
import sys

from ..engine.target import NOT_APPLICABLE, OFF, PATCHED_STATES
from ..targets.fsdp_wgrad import TARGET as FSDP_WGRAD


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


TARGET = FSDP_WGRAD.name


def _target(status):
    return next((t for t in status.targets if t.name == TARGET), None)


def _stop(message: str, code: int) -> int:
    """End the demo in one line on stderr (``gemm-patch demo: ...``) and the exit status given."""
    sys.stdout.flush()
    print(f"gemm-patch demo: {message}", file=sys.stderr)
    return code


def _not_applicable(status, target) -> int:
    mcore = status.versions.get("megatron-core") or "(version unknown)"
    return _stop(f"nothing to show on megatron-core {mcore}: it has no Megatron-FSDP fused wgrad call "
                 f"({TARGET} {target.state}); `gemm-patch status` says what gemm_patch does here", 2)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def main(out: io.TextIOBase | None = None, note: str | None = None) -> int:
    """Exit status: 0 the fix shown; 1 a bad GEMM_PATCH_* value, the patch is not in place
    (strict mode raises GemmPatchError instead) or its result is wrong; 2 nothing to show: no
    torch/megatron-core, a release without the FSDP call, or the patch turned off."""
    import logging

    import gemm_patch

    out = out or sys.stdout
    log = logging.getLogger("gemm_patch")
    try:
        import megatron.core.tensor_parallel.layers as layers
        import torch
    except ImportError as exc:
        return _stop(f"needs torch and megatron-core importable: {exc}", 2)
    from ..gemm.active import active_dispatcher

    st = gemm_patch.status()
    target = _target(st)
    if target is None:
        return _stop(f"this gemm_patch has no {TARGET} target", 1)
    if target.state == NOT_APPLICABLE:
        return _not_applicable(st, target)
    if st.config_error:
        return _stop(f"configuration error: {st.config_error}", 1)
    if target.state == OFF:
        why = target.reason if st.applied else "GEMM_PATCH=0 turns gemm_patch off"
        return _stop(f"{TARGET} is off ({why}): the demo shows the fix, so it needs the patch on", 2)
    if target.state not in PATCHED_STATES:
        return _stop(f"{TARGET} is {target.state}, not patched: {target.reason}", 1)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"megatron-core {st.versions.get('megatron-core')}, torch {torch.__version__}, device {device}", file=out)
    if note:
        print(note.strip(), file=out)
    print("shape: tokens 512, hidden 1024 -> 2048, bf16 activations\n", file=out)

    gemm_patch.revert()
    try:
        _fsdp_step(layers, torch, torch.float32, device)
        print("unpatched, fp32 main_grad: no error (this release does not need the patch here)", file=out)
    except Exception as exc:  # megatron's own failure is what the demo shows
        print(f"unpatched, fp32 main_grad: {_one_line(exc)}", file=out)
    finally:
        status = gemm_patch.apply()
    target = _target(status)
    if target.state == NOT_APPLICABLE:
        return _not_applicable(status, target)
    print(f"patched: {TARGET} {target.state} ({target.reason})\n", file=out)
    if target.state not in PATCHED_STATES:
        return _stop(f"{TARGET} is {target.state}, not patched: {target.reason}", 1)

    dispatcher = active_dispatcher()
    probe = torch.empty(1, 1, dtype=torch.bfloat16, device=device)
    fp32_backend = dispatcher.plan_for(probe, probe, probe.float())[0]
    try:
        rows = [("fp32 (gemm_patch)", fp32_backend, *_fsdp_step(layers, torch, torch.float32, device)),
                ("bf16 (original call)", "torch.matmul", *_fsdp_step(layers, torch, torch.bfloat16, device))]
    except Exception as exc:
        log.debug("the patched run failed", exc_info=True)
        return _stop(f"the patched run failed: {_one_line(exc)} (GEMM_PATCH_LOG_LEVEL=DEBUG shows where)", 1)
    print("| main_grad            | backend      | rel. error vs fp64 | NaN left |", file=out)
    print("|----------------------|--------------|--------------------|----------|", file=out)
    for name, backend, rel, nan_left in rows:
        print(f"| {name:<20} | {backend:<12} | {rel:>18.2e} | {'yes' if nan_left else 'no':<8} |", file=out)
    if rows[0][2] < 1e-5 and not rows[0][3]:
        return 0
    return _stop(f"the patched fp32 main_grad is wrong (relative error {rows[0][2]:.2e} vs fp64)", 1)
