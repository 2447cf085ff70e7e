"""Everything gemm_patch patches: one module per fix a user can switch, one line per target here.

A new target is a ``Target`` (see ``gemm_patch.engine.target``) in the module of its fix and a line in
``REGISTRY`` and an entry in gemm_patch/engine/releases.json (its release data); a new release of a
known target is one line in that entry's ``fingerprints``.
"""

from __future__ import annotations

from ..engine.target import Target
from . import (
    apex_wgrad,
    embedding_wgrad,
    fsdp_wgrad,
    nemo_fsdp_gaf,
    one_rank_scale,
    router_wgrad,
    shared_grad,
    te_dummy_wgrad,
    te_overwrite,
)

REGISTRY: tuple[Target, ...] = (
    fsdp_wgrad.TARGET,  # GEMM_PATCH_FSDP_WGRAD
    apex_wgrad.TARGET,  # GEMM_PATCH_APEX
    te_overwrite.TARGET,  # GEMM_PATCH_TE_OVERWRITE
    te_overwrite.STANDALONE,
    shared_grad.TARGET,  # GEMM_PATCH_SHARED_GRAD
    shared_grad.STANDALONE,
    te_overwrite.MOE_TARGET,
    te_dummy_wgrad.TARGET,  # GEMM_PATCH_TE_DUMMY_WGRAD: Transformer Engine's own layers
    one_rank_scale.TARGET,  # GEMM_PATCH_ONE_RANK_SCALE: Megatron-FSDP's reduce (expert parallelism)
    one_rank_scale.STANDALONE,
    embedding_wgrad.TARGET,  # GEMM_PATCH_EMBEDDING_WGRAD: the embedding lookup into main_grad
    router_wgrad.TARGET,  # GEMM_PATCH_MOE_ROUTER_WGRAD: reports a fused router write it has not verified
    fsdp_wgrad.GEMM_TARGET,  # Megatron-LM main's forms of the same fixes
    te_overwrite.BY_STRATEGY_TARGET,
    te_overwrite.BY_STRATEGY_STANDALONE,
    nemo_fsdp_gaf.TARGET,  # opt-in: GEMM_PATCH_NEMO_FSDP_GAF=1
)


def by_name(name: str) -> Target:
    for target in REGISTRY:
        if target.name == name:
            return target
    raise KeyError(f"no target {name!r}; known: {', '.join(t.name for t in REGISTRY)}")
