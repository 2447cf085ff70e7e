"""fsdp-te-overwrite-by-strategy / mfsdp-te-overwrite-by-strategy: Megatron-LM main's form of
the flag fsdp-te-overwrite resets.

main (unreleased megatron-core 0.20 / megatron-fsdp 0.7.0rc0, Megatron-LM PR #6357) sets
``param.overwrite_main_grad = self.data_parallel_sharding_strategy in ["optim_grads",
"optim_grads_params"]`` in ``MegatronFSDP.all_gather_and_wait_parameters_ready``, so ``optim``
no longer overwrites; a sharded strategy on one data-parallel rank still does, over a buffer
that is not sharded (``is_data_distributed`` is False) and persists across micro-batches. The
wrapper is fsdp-te-overwrite's: run the method, reset the flag where ``main_grad`` persists. It
shares fsdp-te-overwrite's switch, GEMM_PATCH_TE_OVERWRITE (a release has one statement or the
other; the other target reads "not applicable").
"""

from __future__ import annotations

from .te_overwrite import OverwriteFlagTarget

STATEMENT = ('param.overwrite_main_grad = self.data_parallel_sharding_strategy in '
             '["optim_grads", "optim_grads_params"]')
MAIN_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
_COMMON = dict(
    switch="GEMM_PATCH_TE_OVERWRITE",
    relies_on="`param.overwrite_main_grad = <strategy is optim_grads(_params)>` method",
    owner="MegatronFSDP",
    attribute="all_gather_and_wait_parameters_ready",
    statement=STATEMENT,
)

TARGET = OverwriteFlagTarget(
    name="fsdp-te-overwrite-by-strategy",
    distribution="megatron-core",
    module="megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
    fingerprints={
        # 0.13.x-0.19.x: `param.overwrite_main_grad = True` (fsdp-te-overwrite) or nothing.
        # main reports "0.20.0" (the coming release's version): keyed by the pinned commit.
        f"main@{MAIN_COMMIT[:8]}": "5666668a84917ee9",
    },
    **_COMMON,
)

# The same class shipped on its own (megatron-fsdp, imported as ``megatron_fsdp``).
STANDALONE = OverwriteFlagTarget(
    name="mfsdp-te-overwrite-by-strategy",
    distribution="megatron-fsdp",
    module="megatron_fsdp.megatron_fsdp",
    fingerprints={
        # 0.1.0-0.6.1: the unconditional statement (mfsdp-te-overwrite) or nothing.
        # main's copy reports "0.7.0rc0": keyed by the pinned commit.
        f"main@{MAIN_COMMIT[:8]}": "5666668a84917ee9",
    },
    **_COMMON,
)
