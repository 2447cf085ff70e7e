"""The exact fallback backend: results bit for bit those of 0.2.0's implementation (kept below
as the reference), with one wide M x N temporary fewer where ``main_grad`` is narrower than
the product (peak memory measured as the process's peak resident set, Linux only)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from gemm_patch.gemm.backends import ExactFallbackBackend  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def reference_gemm(a, b, out, accumulate) -> None:
    """ExactFallbackBackend.gemm as released in 0.2.0."""
    wide = torch.float64 if torch.float64 in (a.dtype, b.dtype, out.dtype) else torch.float32
    a_wide, b_wide = a.to(wide), b.to(wide)
    if out.dtype == wide:
        if accumulate:
            out.addmm_(a_wide, b_wide)
        else:
            torch.mm(a_wide, b_wide, out=out)
    elif accumulate:
        out.copy_(torch.addmm(out.to(wide), a_wide, b_wide))
    else:
        out.copy_(torch.mm(a_wide, b_wide))


F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
DTYPES = [  # (a, b, out)
    (BF16, BF16, F32), (F16, F16, F32), (F32, F32, BF16), (F32, F32, F16), (BF16, BF16, BF16),
    (BF16, BF16, F16), (F32, F32, F32), (BF16, F32, BF16), (F64, BF16, F32), (F32, F32, F64),
]
SHAPES = [(1, 1, 1), (7, 13, 5), (64, 300, 96), (257, 1024, 129), (512, 96, 768)]  # (M, K, N)


def operands(m, k, n, dtypes, seed, out_layout="contiguous"):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(k, m, generator=gen) * 3).to(dtypes[0]).t()  # grad_output.t(), as megatron passes it
    b = (torch.randn(k, n, generator=gen) * 3).to(dtypes[1])
    out = torch.randn(m, n, generator=gen).to(dtypes[2])
    if out_layout == "transposed":
        out = out.t().contiguous().t()
    elif out_layout == "strided":  # a column slice of a wider buffer
        out = torch.cat([out, torch.zeros(m, 3, dtype=out.dtype)], dim=1)[:, :n]
    return a, b, out


def bits(t):
    """The bit patterns, so that -0.0 against 0.0 (or two NaNs) count as differences too."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: "-".join(str(t).split(".")[1] for t in d))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fallback_is_bit_identical_to_the_previous_implementation(shape, dtypes, accumulate):
    a, b, out = operands(*shape, dtypes, seed=sum(shape))
    expected = out.clone()
    reference_gemm(a, b, expected, accumulate)
    ExactFallbackBackend().gemm(a, b, out, accumulate)
    assert out.dtype == expected.dtype and torch.equal(bits(out), bits(expected))


@pytest.mark.parametrize("out_layout", ["transposed", "strided"])
@pytest.mark.parametrize("dtypes", [(F32, F32, BF16), (BF16, BF16, F32), (BF16, BF16, BF16)],
                         ids=lambda d: "-".join(str(t).split(".")[1] for t in d))
def test_fallback_is_bit_identical_into_a_non_contiguous_main_grad(dtypes, out_layout):
    a, b, out = operands(200, 384, 72, dtypes, seed=3, out_layout=out_layout)
    expected = out.clone()
    reference_gemm(a, b, expected, True)
    stride = out.stride()
    ExactFallbackBackend().gemm(a, b, out, True)
    assert out.stride() == stride
    assert torch.equal(bits(out), bits(expected))


# Prints the peak resident memory (MiB) that one gemm call adds on top of its inputs.
PEAK = textwrap.dedent("""
    import sys, torch
    from gemm_patch.gemm.backends import ExactFallbackBackend
    torch.set_num_threads(1)
    m, k, n = map(int, sys.argv[1:4])
    a_dtype, out_dtype = getattr(torch, sys.argv[4]), getattr(torch, sys.argv[5])
    a = torch.randn(k, m).to(a_dtype).t()
    b = torch.randn(k, n).to(a_dtype)
    out = torch.randn(m, n).to(out_dtype)
    gemm = ExactFallbackBackend().gemm
    gemm(a[:8], b, out[:8], True)  # BLAS buffers and lazy initialisation, before measuring

    def kib(field):
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current resident set
    base = kib("VmRSS")
    gemm(a, b, out, True)
    print((kib("VmHWM") - base) / 1024)
""")


def peak_extra_mib(m, k, n, a_dtype, out_dtype) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "GEMM_PATCH": "0", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", PEAK, str(m), str(k), str(n), a_dtype, out_dtype],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.split()[-1])


needs_proc = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                                reason="peak resident set reset needs Linux's /proc/self/clear_refs")
SLACK_MIB = 24  # BLAS packing buffers and allocator rounding (about 7 MiB measured)


@needs_proc
def test_fp32_inputs_into_a_16_bit_main_grad_take_one_wide_buffer():
    m, k, n = 4096, 512, 4096
    wide_out = 4 * m * n / MiB  # 64 MiB; 0.2.0 held two (about 135 MiB measured)
    extra = peak_extra_mib(m, k, n, "float32", "bfloat16")
    assert extra < wide_out + SLACK_MIB, f"{extra:.1f} MiB over the inputs, one fp32 M x N is {wide_out:.0f}"


@needs_proc
def test_16_bit_inputs_into_an_fp32_main_grad_take_only_the_operand_copies():
    m, k, n = 4096, 2048, 2048
    operands_wide = 4 * (m * k + k * n) / MiB  # 48 MiB
    extra = peak_extra_mib(m, k, n, "bfloat16", "float32")
    assert extra < operands_wide + SLACK_MIB, f"{extra:.1f} MiB over the inputs, fp32 operands are {operands_wide:.0f}"
