"""validation/parity/autograd_oracle.py's fp64 oracle on the CPU: the TE-spec names it maps onto
megatron's local layer spec (the names of a real pretrain_gpt.py model, from its Megatron-FSDP log),
and, with a megatron-core release in a subprocess, a tiny tied GPT's fp64 step-1 gradient: every
parameter, float64, the derivative of the loss the model computes (central differences along a
random direction), fp32 within 1e-5 of it and bf16 at bf16's distance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from validation.parity import autograd_oracle
from validation.tests.test_convergence_data import _release_tree

ROOT = Path(__file__).resolve().parents[2]

# From the Megatron-FSDP parameter-group listing of pretrain_gpt.py's model (megatron-core 0.19.2, TE spec)
TE_NAMES = {
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": "decoder.layers.0.input_layernorm.weight",
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias": "decoder.layers.0.input_layernorm.bias",
    "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": "decoder.layers.3.pre_mlp_layernorm.weight",
    "decoder.layers.3.mlp.linear_fc1.layer_norm_bias": "decoder.layers.3.pre_mlp_layernorm.bias",
    "decoder.layers.0.self_attention.linear_qkv.weight": "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.mlp.linear_fc1.bias": "decoder.layers.0.mlp.linear_fc1.bias",
    "decoder.final_layernorm.weight": "decoder.final_layernorm.weight",
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
}

PROBE = r"""
import contextlib, json, sys
import torch
import megatron_cpu
import megatron.core.tensor_parallel as tensor_parallel
from validation.parity.autograd_oracle import dense_gradients, seeded_model

torch.cuda.current_device = lambda: "cpu"  # megatron allocates its attention workspace there


class NoFork:  # attention dropout (p = 0) runs inside the CUDA RNG tracker's fork
    fork = staticmethod(contextlib.nullcontext)


tensor_parallel.get_cuda_rng_tracker = NoFork
run = {"name": "t", "spec": "local", "layers": 2, "hidden": 64, "seq": 16, "vocab": 128, "micro_batch_size": 2,
       "micro_batches": 2, "tied": "on", "position_embedding": "learned_absolute", "seed": 3, "fusion": "off",
       "main_grads_dtype": "fp32", "sharding": "optim_grads_params", "lr": 1e-4, "adam_beta2": 0.95}
rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())
with megatron_cpu.model_parallel():
    _, gpt = seeded_model(run, "cpu")
    weights = {n: p.detach().double() for n, p in gpt.named_parameters()}
    g64, losses = dense_gradients(run, weights, torch.float64, "cpu")
    gen = torch.Generator().manual_seed(0)
    direction = {n: torch.randn(w.shape, generator=gen, dtype=torch.float64) * w.std().clamp(min=1e-2)
                 for n, w in weights.items()}
    eps = 1e-3
    ends = [sum(dense_gradients(run, {n: w + s * eps * direction[n] for n, w in weights.items()}, torch.float64,
                                "cpu")[1]) / run["micro_batches"] for s in (1, -1)]
    print("RESULT" + json.dumps({
        "names": sorted(g64), "weights": sorted(weights), "dtypes": sorted({str(g.dtype) for g in g64.values()}),
        "loss": losses, "directional": float(sum((g64[n] * direction[n]).sum() for n in g64)),
        "central_difference": (ends[0] - ends[1]) / (2 * eps),
        "fp32": max(rel(g, g64[n]) for n, g in dense_gradients(run, weights, torch.float32, "cpu")[0].items()),
        "bf16": sorted(rel(g, g64[n]) for n, g in dense_gradients(run, weights, torch.bfloat16, "cpu")[0].items()),
    }))
"""


def test_te_spec_names_map_onto_the_local_spec():
    assert {n: autograd_oracle.local_name(n) for n in TE_NAMES} == TE_NAMES


def test_fp64_gradient_of_a_tied_gpt_on_the_cpu():
    proc = subprocess.run([sys.executable, "-c", PROBE, str(ROOT)], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore",
                               "PYTHONPATH": f"{_release_tree()}:{ROOT}:{ROOT / 'tests' / 'megatron'}"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[0][len("RESULT"):])
    assert r["names"] == r["weights"] and "embedding.word_embeddings.weight" in r["names"]
    assert "output_layer.weight" not in r["names"]  # tied: the embedding is the output layer's weight
    assert r["dtypes"] == ["torch.float64"]
    assert all(abs(loss - 4.852) < 0.3 for loss in r["loss"])  # about ln(128) at initialisation
    assert abs(r["directional"] - r["central_difference"]) <= 1e-3 * abs(r["central_difference"]), r
    assert r["fp32"] < 1e-5
    assert 1e-4 < r["bf16"][0] and r["bf16"][-1] < 0.05  # bf16's rounding, far from fp64's


def test_fp64_step_commands_and_comparison(tmp_path):
    import torch

    from validation.parity import fp64_step

    (reference, ref_cmd, ref_env), (patched, on_cmd, on_env) = fp64_step.commands(tmp_path, "python3")
    assert ref_env == {"GEMM_PATCH": "0"} and "gemm_patch" not in ref_cmd
    assert on_cmd[:5] == ["python3", "-m", "gemm_patch", "run", "--"] and on_cmd[-1] == "--require-patch"
    assert {r["name"]: r.get("mode") for r in fp64_step.plans(tmp_path)["reference"]} == {
        "fp64": "fp64", "autograd": "autograd", "fusion_off": None, "fusion_off_repeat": None}
    exact = {"embedding.word_embeddings.weight": torch.ones(4, 2, dtype=torch.float64),
             "decoder.layers.0.mlp.linear_fc1.weight": torch.ones(3, dtype=torch.float64)}
    off = {n: t * (1 + 4e-3) for n, t in exact.items()}  # one bf16 rounding away
    on = {n: t * (1 + 1e-4) for n, t in exact.items()}
    for name, grads in (("fp64", exact), ("autograd", off), ("fusion_off", off), ("patched", on)):
        torch.save({"format": "gemm_patch.grad_dump/1", "grads": {n: g.float() for n, g in grads.items()}},
                   tmp_path / f"{name}.pt")
    for part, names in (("reference", ("fp64", "autograd", "fusion_off")), ("patched", ("patched",))):
        (tmp_path / f"{part}.json").write_text(json.dumps({"runs": [{"name": n, "init_hash": "h"} for n in names]}))
    result = fp64_step.compare(tmp_path)
    assert result["runs"] == ["patched", "fusion_off", "autograd"]
    assert result["closer"] == {"patched": 2, "fusion_off": 0, "params": 2}
    assert abs(result["overall"]["fusion_off"] - 4e-3) < 1e-6 and abs(result["overall"]["patched"] - 1e-4) < 1e-6
    assert result["same_initial_weights"] and result["oracle_matches_model"] and not result["errors"]
    assert "closer to fp64: patched on 2 of 2 parameters" in fp64_step.table(result)
