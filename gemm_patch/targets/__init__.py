"""Everything gemm_patch patches: one module per target, one line each here.

A new target is a module with a ``Target`` (see ``base``) and a line in ``REGISTRY``; a new
release of a known target is one line in that target's ``fingerprints``.
"""

from __future__ import annotations

from . import (
    apex_wgrad,
    fsdp_wgrad,
    fsdp_wgrad_gemm,
    moe_overwrite,
    nemo_fsdp_gaf,
    one_rank_scale,
    shared_grad,
    te_dummy_wgrad,
    te_overwrite,
    te_overwrite_by_strategy,
)
from .base import Target

REGISTRY: tuple[Target, ...] = (
    fsdp_wgrad.TARGET,
    apex_wgrad.TARGET,
    te_overwrite.TARGET,
    te_overwrite.STANDALONE,
    shared_grad.TARGET,
    shared_grad.STANDALONE,
    moe_overwrite.TARGET,
    te_dummy_wgrad.TARGET,  # Transformer Engine's own layers
    one_rank_scale.TARGET,  # Megatron-FSDP's reduce, not the wgrad: expert parallelism
    one_rank_scale.STANDALONE,
    # Megatron-LM main (0.20.0 before its release), pinned commit.
    fsdp_wgrad_gemm.TARGET,
    te_overwrite_by_strategy.TARGET,
    te_overwrite_by_strategy.STANDALONE,
    nemo_fsdp_gaf.TARGET,  # opt-in: GEMM_PATCH_NEMO_FSDP_GAF=1
)


def by_name(name: str) -> Target:
    for target in REGISTRY:
        if target.name == name:
            return target
    raise KeyError(f"no target {name!r}; known: {', '.join(t.name for t in REGISTRY)}")
