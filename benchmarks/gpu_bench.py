"""Weight-gradient GEMM into main_grad on the current GPU, every way side by side, one run.

    python -m benchmarks.gpu_bench --json results.json      # needs CUDA; TE optional

Overwrite (Megatron-FSDP's call, fp32 main_grad from bf16 activations):
  matmul_bf16    torch.matmul(a, b, out=bf16 main_grad)       what users run today; the bar
  unfused        bf16 torch.matmul, then copy_ into fp32         the workaround
  te             gemm_patch dispatcher -> TE general_gemm         (the patched call's entry point)
  native         gemm_patch dispatcher -> torch.mm(out_dtype=)
  fallback       gemm_patch dispatcher -> exact fp32 upcast
Accumulate (apex's wgrad_gemm_accum_fp32 stand-in):
  acc_unfused    bf16 torch.matmul, then add_ into fp32
  acc_te / acc_native   the dispatcher with accumulate=True

Per method and shape: median time (CUDA events), TFLOP/s, relative error against fp64, extra
peak memory over the operands. Then the host cost per call on a tiny (launch-bound) GEMM.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time

import torch

SHAPES = [(2048, 1024, 1024), (8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096),
          (16384, 8192, 8192), (4096, 4096, 128256)]  # (tokens, in, out)


def environment() -> dict:
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True).stdout.strip().splitlines()[0]
    except Exception:
        info["driver"] = None
    try:
        import transformer_engine

        info["transformer_engine"] = transformer_engine.__version__
    except Exception:
        info["transformer_engine"] = None
    try:
        from megatron.core import package_info

        info["megatron_core"] = package_info.__version__
    except Exception:
        info["megatron_core"] = None
    import gemm_patch

    info["gemm_patch"] = gemm_patch.__version__
    return info


def methods(backends: dict) -> dict:
    from gemm_patch.gemm.dispatcher import WgradDispatcher

    def via(name, accumulate):
        disp = WgradDispatcher(name)
        if accumulate:
            return lambda a, b, out: disp.gemm(a, b, out, True)
        return lambda a, b, out: disp.gemm(a, b, out, False)

    table = {
        "matmul_bf16": ("bf16", lambda a, b, out: torch.matmul(a, b, out=out)),
        "unfused": ("fp32", lambda a, b, out: out.copy_(torch.matmul(a, b))),
        "fallback": ("fp32", via("fallback", False)),
        "acc_unfused": ("fp32", lambda a, b, out: out.add_(torch.matmul(a, b))),
    }
    for name in ("te", "native"):
        if backends[name].unavailable_reason() is None:
            table[name] = ("fp32", via(name, False))
            table[f"acc_{name}"] = ("fp32", via(name, True))
    order = ["matmul_bf16", "unfused", "te", "native", "fallback", "acc_unfused", "acc_te", "acc_native"]
    return {k: table[k] for k in order if k in table}


def event_times(fn, iters: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def bench_shape(shape, table, warmup, iters, rounds) -> list[dict]:
    tokens, k, n = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    grad_output = torch.randn(tokens, n, device="cuda", generator=gen).to(torch.bfloat16)
    total_input = torch.randn(tokens, k, device="cuda", generator=gen).to(torch.bfloat16)
    a, b = grad_output.t(), total_input
    ref = a.double() @ b.double()
    ref_norm = ref.norm()
    flop = 2.0 * tokens * k * n
    rows, calls = {}, {}
    for name, (dtype, fn) in table.items():
        out = torch.zeros(n, k, device="cuda", dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
        fn(a, b, out)  # first call: plan + lazy init outside the measurement
        torch.cuda.synchronize()
        out.zero_()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(a, b, out)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        rel = float((out.double() - ref).norm() / ref_norm)
        rows[name] = {"shape": list(shape), "method": name, "out_dtype": dtype, "rel_err": rel,
                      "extra_mib": extra / 2**20, "samples": []}
        calls[name] = functools.partial(fn, a, b, out)
        for _ in range(warmup):
            calls[name]()
    del ref
    # Rounds interleave the methods so clock and thermal drift fall on all of them alike.
    for _ in range(rounds):
        for name, call in calls.items():
            rows[name]["samples"] += event_times(call, iters)
    for row in rows.values():
        row["ms"] = statistics.median(row["samples"])
        row["tflops"] = flop / row["ms"] / 1e9
        row["n"] = len(row.pop("samples"))
    del calls, grad_output, total_input
    torch.cuda.empty_cache()
    return list(rows.values())


def host_cost(backends: dict, calls: int = 2000) -> dict:
    """Per-call host time on a 64^3 GEMM: launch-bound, so it is the Python+dispatch cost."""
    from gemm_patch.gemm.dispatcher import WgradDispatcher

    a = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    b = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    out = torch.zeros(64, 64, device="cuda")
    out16 = torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16)
    fns = {"torch.matmul (bf16 out)": lambda: torch.matmul(a, b, out=out16)}
    for name in ("te", "native", "fallback"):
        if backends[name].unavailable_reason() is None:
            backend = backends[name]
            disp = WgradDispatcher(name, backends=backends)
            fns[f"{name} backend direct"] = lambda backend=backend: backend.gemm(a, b, out, False)
            fns[f"{name} via dispatcher"] = lambda disp=disp: disp.gemm(a, b, out, False)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(7):  # interleaved rounds; the median round per method
        for name, fn in fns.items():
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            samples[name].append((t1 - t0) / calls * 1e6)
    result = {name: statistics.median(values) for name, values in samples.items()}
    for name in ("te", "native", "fallback"):
        if f"{name} via dispatcher" in result:
            overhead = result[f"{name} via dispatcher"] - result[f"{name} backend direct"]
            result[f"dispatcher overhead over {name}"] = overhead
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description="wgrad GEMM benchmark")
    parser.add_argument("--json", default="gpu_bench.json")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=10, help="timed calls per method per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", default="all", help="'all' or indices like 0,1")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from gemm_patch.gemm.backends import all_backends

    backends = all_backends()
    table = methods(backends)
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    rows = []
    for shape in shapes:
        rows += bench_shape(shape, table, args.warmup, args.iters, args.rounds)
    host = host_cost(backends)
    result = {"env": environment(), "rows": rows, "host_us_per_call": host,
              "unavailable": {n: r for n, b in backends.items() if (r := b.unavailable_reason())}}
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=1)

    print("| shape (tokens,in,out) | method | ms | TFLOP/s | x bf16 | rel.err vs fp64 | extra MiB |")
    print("|---|---|---|---|---|---|---|")
    for shape in shapes:
        sub = [r for r in rows if tuple(r["shape"]) == shape]
        bar = next(r["ms"] for r in sub if r["method"] == "matmul_bf16")
        for r in sub:
            print(f"| {shape} | {r['method']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['ms'] / bar:.3f} | "
                  f"{r['rel_err']:.2e} | {r['extra_mib']:.0f} |")
    print("\n| host cost per call (64^3 GEMM) | us |\n|---|---|")
    for name, us in host.items():
        print(f"| {name} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
