"""The GEMM layer: ``dispatcher`` (the one object every patched call site calls) over
``backends`` (native, Transformer Engine, exact fallback). Knows nothing of patching."""
