"""The GEMM layer: ``dispatcher`` (the one object every patched call site calls) over
``backends`` (native, Transformer Engine, exact fallback), and ``active``, the process-wide
dispatcher the patcher hands its backend setting. Knows nothing of patching; this package and
``active`` import no torch (``dispatcher`` and ``backends`` do)."""

# The backends (gemm_patch/gemm/backends.py, one class each) in the default preference order.
# native first: on the H200 native and TE gave bitwise-identical main_grads at the same GPU time,
# and native costs less host time per call (benchmarks/results/). TE stays next for torch builds
# without mm(..., out_dtype=); the exact fallback is always last.
BACKEND_ORDER = ("native", "te", "fallback")
