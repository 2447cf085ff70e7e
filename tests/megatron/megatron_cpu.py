"""megatron-core's real tensor-parallel layers on the CPU: a one-process gloo group, model-parallel
state of size 1, CPU initialisation. Shared by the tests and by subprocess snippets (which put
this folder on sys.path)."""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch

FUSION_MESSAGE = ("gradient_accumulation_fusion set to True but the custom CUDA extension "
                  "fused_weight_gradient_mlp_cuda")


@contextlib.contextmanager
def model_parallel():
    """Model-parallel state of size 1 over a one-process gloo group (what the layers' constructors
    read: the tensor-parallel group, its size and rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with tempfile.TemporaryDirectory() as tmp:
        owns_group = not dist.is_initialized()
        if owns_group:
            dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                                    rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if owns_group:
                dist.destroy_process_group()


def config(fusion: bool = True, params_dtype=torch.bfloat16):
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(use_cpu_initialization=True, gradient_accumulation_fusion=fusion,
                               params_dtype=params_dtype)


def build(kind: str, in_features: int = 64, out_features: int = 80, fusion: bool = True):
    """``ColumnParallelLinear`` or ``RowParallelLinear`` through megatron's own constructor."""
    from megatron.core.tensor_parallel import layers

    kwargs = dict(config=config(fusion), init_method=torch.nn.init.xavier_normal_, bias=False)
    if kind == "column":
        return layers.ColumnParallelLinear(in_features, out_features, **kwargs)
    return layers.RowParallelLinear(in_features, out_features, input_is_parallel=True,
                                    skip_bias_add=False, **kwargs)


def step(layer, seed: int, tokens: int = 12, batch: int = 3):
    """One forward/backward of ``layer`` on [tokens, batch, in] bf16 input; returns the fp64
    weight gradient the step should add to ``main_grad``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, batch, layer.input_size, generator=gen).to(torch.bfloat16).requires_grad_()
    y, _ = layer(x)
    grad_out = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
    y.backward(grad_out)
    go2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.detach().reshape(-1, x.shape[-1])
    return go2.double().t() @ x2.double()


def unknown_release(*names: str) -> str:
    """Snippet: this process's gemm_patch pretends the installed release is unknown to the named
    targets (their fingerprint tables emptied); the code that runs is the real release's."""
    return ("import dataclasses, gemm_patch.engine.patcher as p\n"
            f"p.use_targets(tuple(dataclasses.replace(x, fingerprints={{}}) if x.name in {names!r} else x "
            "for x in p.targets()))\n")
