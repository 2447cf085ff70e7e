"""gemm-patch doctor: does the backend this process would use compute the wgrad GEMM
right, here, on this device?

Every backend of the dispatcher runs each case (16-bit inputs into an fp32 output, with and
without accumulation: what the patched call sites send) on random inputs, and is compared
with the same product in fp64. The report shows which backend the dispatcher would pick per
case; the exit status is non-zero when that one is wrong, or is not the one
GEMM_PATCH_BACKEND asks for, or when a variable holds a bad value.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import Any

# fp32 accumulation of K products keeps the relative (Frobenius) error near sqrt(K) * 2^-24,
# about 1e-6 here; TF32 (1e-3) or a 16-bit result (4e-3) are far above this bound.
TOLERANCE = 1e-5
SHAPE = (192, 256, 160)  # M, K, N: not powers of two, so no kernel gets a lucky tile


@dataclass
class CaseResult:
    case: str
    active: str | None  # the backend the dispatcher would run first; None: nothing can
    results: dict[str, str] = field(default_factory=dict)  # backend -> "ok 3.1e-08", "n/a", ...
    ok: bool = True
    problem: str | None = None


@dataclass
class Report:
    version: str
    device: str
    torch: str
    backend_setting: str
    config_error: str | None
    unavailable: dict[str, str]
    cases: list[CaseResult]

    @property
    def ok(self) -> bool:
        return self.config_error is None and all(c.ok for c in self.cases)

    def as_dict(self) -> dict[str, Any]:
        return {"schema": 1, "ok": self.ok, **asdict(self)}


def _cases(torch):
    for dtype in (torch.bfloat16, torch.float16):
        for accumulate in (False, True):
            yield dtype, torch.float32, accumulate


def _check(backend, a, b, out_init, accumulate, torch) -> tuple[bool, str]:
    out = out_init.clone()
    try:
        backend.gemm(a, b, out, accumulate)
    except Exception as exc:
        return False, f"error {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    reference = a.double() @ b.double()
    if accumulate:
        reference += out_init.double()
    if torch.isnan(out).any():
        return False, "WRONG (NaN left in out)"
    rel = ((out.double() - reference).norm() / reference.norm()).item()
    return rel <= TOLERANCE, f"{'ok' if rel <= TOLERANCE else 'WRONG'} {rel:.1e}"


def run_checks(device: str | None = None, dispatcher=None, seed: int = 0) -> Report:
    import torch

    import gemm_patch

    from ..gemm.active import active_dispatcher

    st = gemm_patch.status()  # GEMM_PATCH_BACKEND as the patcher read it: the variables are parsed there only
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dispatcher = dispatcher if dispatcher is not None else active_dispatcher()
    unavailable = {name: why for name, b in dispatcher.backends.items()
                   if (why := b.unavailable_reason()) is not None}
    gen = torch.Generator().manual_seed(seed)
    m, k, n = SHAPE
    cases = []
    for dtype, out_dtype, accumulate in _cases(torch):
        a = torch.randn(m, k, generator=gen).to(device, dtype)
        b = torch.randn(k, n, generator=gen).to(device, dtype)
        out_init = (torch.randn(m, n, generator=gen) if accumulate
                    else torch.full((m, n), float("nan"))).to(device, out_dtype)
        name = f"{_short(dtype)} x {_short(dtype)} {'+=' if accumulate else '->'} {_short(out_dtype)}"
        plan = dispatcher.plan_for(a, b, out_init, accumulate)
        result = CaseResult(name, plan[0] if plan else None)
        # The dispatcher's order first (native > te > fallback), as everywhere else.
        for backend_name in [*dispatcher.order, *(n for n in dispatcher.backends if n not in dispatcher.order)]:
            backend = dispatcher.backends[backend_name]
            if backend_name in unavailable:
                result.results[backend_name] = "unavailable"
            elif not backend.supports(a, b, out_init):
                result.results[backend_name] = "n/a"
            else:
                good, text = _check(backend, a, b, out_init, accumulate, torch)
                result.results[backend_name] = text
                if backend_name == result.active and not good:
                    result.ok, result.problem = False, f"active backend {backend_name} is {text}"
        if result.active is None:
            result.ok, result.problem = False, "no backend can run this case"
        elif dispatcher.forced not in ("auto", "fallback") and result.active != dispatcher.forced:
            why = unavailable.get(dispatcher.forced, "it cannot run these dtypes on this device")
            result.ok = False
            result.problem = (f"GEMM_PATCH_BACKEND={dispatcher.forced} is missing ({why}); "
                              f"{result.active} would run instead")
        cases.append(result)
    return Report(st.version, device, torch.__version__, st.backend, st.config_error, unavailable, cases)


def _short(dtype) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(
        str(dtype).removeprefix("torch."), str(dtype))


def format_report(report: Report, patch_line: str | None = None) -> str:
    names = list(report.cases[0].results) if report.cases else []
    m, k, n = SHAPE
    lines = [f"gemm_patch {report.version} doctor: device {report.device}, torch {report.torch}, "
             f"GEMM_PATCH_BACKEND={report.backend_setting}"]
    if patch_line:
        lines.append(patch_line)
    lines += [f"each backend on random ({m}x{k}) @ ({k}x{n}) vs fp64, "
              f"relative error must be <= {TOLERANCE:.0e}", ""]
    header = ["case", *names, "active"]
    rows = [[c.case, *(c.results[nm] for nm in names), c.active or "MISSING"] for c in report.cases]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        lines.append("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |")
    lines.append("")
    for name, why in report.unavailable.items():
        lines.append(f"{name}: unavailable: {why}")
    if report.config_error:
        lines.append(f"configuration error: {report.config_error}")
    problems: dict[str, list[str]] = {}
    for c in report.cases:
        if c.problem:
            problems.setdefault(c.problem, []).append(c.case)
    for problem, cases in problems.items():
        where = "every case" if len(cases) == len(report.cases) else ", ".join(cases)
        lines.append(f"{where}: {problem}")
    actives = sorted({c.active for c in report.cases if c.active})
    lines.append(f"result: {'OK' if report.ok else 'FAILED'}: active backend "
                 f"{', '.join(actives) or 'none'} on {report.device}")
    return "\n".join(lines)


def device_problem(device: str | None) -> str | None:
    """Why the doctor cannot run on ``device`` here (one line), or None."""
    try:
        import torch
    except ImportError as exc:
        return f"needs torch importable: {exc}"
    if device == "cuda" and not torch.cuda.is_available():
        if not torch.backends.cuda.is_built():
            return (f"--device cuda: this torch ({torch.__version__}) is built without CUDA; "
                    f"use --device cpu, or install a CUDA build of torch")
        return (f"--device cuda: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device; "
                f"check CUDA_VISIBLE_DEVICES and the driver, or use --device cpu")
    return None


def patch_summary(import_targets: bool = True) -> str:
    """One line on the patch itself: the state of each target (importing them first)."""
    import gemm_patch

    from ..engine.patcher import import_target_modules

    if import_targets:
        import_target_modules()
    st = gemm_patch.status()
    shown = [t for t in st.targets if st.applies(t)]
    targets = ", ".join(f"{t.name} {t.state}" for t in shown) or "none"
    rest = len(st.targets) - len(shown)
    mcore = st.versions.get("megatron-core") or "not installed"
    return (f"patch: {'applied' if st.applied else 'not applied'}; megatron-core {mcore}: {targets}"
            f"{f' (+{rest} not applicable here)' if rest else ''}")


def main(device: str | None = None, as_json: bool = False, import_targets: bool = True,
         note: str | None = None) -> int:
    """Exit status: 0 the backend in use is right; 1 it is wrong or missing, or a variable holds
    a bad value; 2 the device asked for is not there (one line on stderr). ``note``: a line
    printed under the patch line (the ``gemm-patch`` command's count of import warnings)."""
    import json

    problem = device_problem(device)
    if problem:
        print(f"gemm-patch doctor: {problem}", file=sys.stderr)
        return 2
    report = run_checks(device)
    if as_json:
        print(json.dumps(report.as_dict(), indent=2, sort_keys=True))
        if note:  # stdout stays pure JSON
            print(note.strip(), file=sys.stderr)
    else:
        patch_line = patch_summary(import_targets)
        print(format_report(report, f"{patch_line}\n{note}" if note else patch_line))
    sys.stdout.flush()
    return 0 if report.ok else 1
