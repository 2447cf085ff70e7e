"""A MegatronFSDP whose ``all_gather_and_wait_parameters_ready`` can run on a CPU: the real
class of a release (megatron-core's copy or the standalone megatron-fsdp), made with
``object.__new__`` and holding only the attributes that method reads (a real MegatronFSDP needs
CUDA and process groups), and parameters carrying Megatron-FSDP's ``_gbuf`` interface.

Shared by every test that runs a release's own method (no megatron import here)."""

from __future__ import annotations

import types

import torch

METHOD = "all_gather_and_wait_parameters_ready"
STATEMENT = "param.overwrite_main_grad = True"


class AllGatherPipeline:
    """Records what the method asks of the all-gather pipeline (CPU: nothing to gather)."""

    def __init__(self):
        self.gathered, self.waited = [], []

    def all_gather_params(self, params, **kwargs):
        self.gathered.append(list(params))

    def wait_bucket_ready(self, bucket_id, *args):
        self.waited.append(bucket_id)


def megatron_fsdp(cls: type, strategy: str = "optim_grads_params", params=()):
    """An instance of ``cls`` (a release's MegatronFSDP) without ``__init__``."""
    obj = object.__new__(cls)
    vars(obj).update(
        data_parallel_sharding_strategy=strategy,
        all_gather_pipeline=AllGatherPipeline(),
        suggested_AG_prefetch_size=None,
        dist_index=types.SimpleNamespace(use_hybrid_fsdp=False),
        ddp_config=types.SimpleNamespace(outer_dp_sharding_strategy="no_shard"),
        microbatch_count=0,
        model_auto_sync=False,
        param_and_grad_buffer=types.SimpleNamespace(param_to_param_group={p: i for i, p in enumerate(params)}),
    )
    return obj


def fsdp_param(distributed: bool | None):
    """A parameter as Megatron-FSDP leaves it: ``_gbuf`` is its gradient buffer, whose
    ``is_data_distributed`` says whether main_grad is a fresh bucket (True: sharded gradients on
    several data-parallel ranks) or the persistent buffer (False). None: no ``_gbuf`` at all."""
    param = torch.nn.Parameter(torch.zeros(4, 4))
    if distributed is not None:
        param._gbuf = types.SimpleNamespace(is_data_distributed=distributed)
    return param
