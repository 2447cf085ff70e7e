#!/usr/bin/env python
"""GPU memory of a tied-embedding GPT under Megatron-FSDP: gemm-patch against fusion off.

With tied embeddings megatron's fused backward returns a zeros dummy ``grad_weight`` for the
shared weight (``zero_out_wgrad``); with TE installed it is ``get_dummy_wgrad(..., zero=True)``,
one tensor of the output layer's shape kept for the whole process (1002 MB at 128256 x 4096).
gemm-patch's fsdp-wgrad returns one zero broadcast to that shape instead;
``GEMM_PATCH_FSDP_DUMMY_GRAD=0`` puts megatron's own dummy back (gemm-patch before the fix).

Each configuration runs in its own process, all at once on one GPU (``memory_allocated`` counts a
process's own memory): a GPT of one layer, hidden 1024 and vocabulary 131072 (the output layer's
bf16 weight: 256 MiB), TE layers where TE is installed (else megatron's local ones), megatron-core's
``FullyShardedDataParallel`` (``optim_grads_params``, fp32 main grads, bf16), built by
validation/parity/train_gpt_fsdp.py's own functions; 3 steps of 2 micro-batches, forward and
backward and ``finish_grad_sync`` (no optimizer: its state is the same in every configuration).

  * tied: fusion off (no gemm_patch), gemm-patch, gemm-patch with GEMM_PATCH_FSDP_DUMMY_GRAD=0
  * untied: fusion off, gemm-patch

Prints, per configuration, the memory allocated after the last step, the peak over the steps, and
each against fusion off's, then PASS where gemm-patch is at most fusion off + 0.05 GiB, tied and
untied. About 30 s on an H200, start-up included.

    python -m validation.probes.tied_dummy_memory [--out DIR] [--pythonpath DIR]

``--pythonpath`` puts a folder first on the children's PYTHONPATH (a megatron-core release, e.g.
``$GEMM_PATCH_MCORE_ROOT/mc0192``). Without TE megatron's zeros dummy is a fresh ``torch.zeros``
per backward, so fusion on held nothing extra there before the fix either; ``--emulate-te-cache``
gives megatron's layers a ``get_dummy_wgrad`` that caches as TE's does (one tensor per shape and
dtype, zero-filled where asked) to see the cached dummy's cost on a machine without TE.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
MODEL = {"layers": 1, "hidden": 1024, "vocab": 131072, "seq": 1024, "micro_batch_size": 1}
MICRO_BATCHES, STEPS = 2, 3
CONFIGS = {  # name: (tied, fusion under gemm_patch, extra environment)
    "tied fusion off": (True, False, {}),
    "tied gemm-patch": (True, True, {}),
    "tied gemm-patch, GEMM_PATCH_FSDP_DUMMY_GRAD=0": (True, True, {"GEMM_PATCH_FSDP_DUMMY_GRAD": "0"}),
    "untied fusion off": (False, False, {}),
    "untied gemm-patch": (False, True, {}),
}
TOLERANCE = 0.05 * 2**30
MIB = 2**20


def emulate_te_cache(layers) -> None:
    """megatron's layers module as with TE installed, as far as the dummy goes: ``HAVE_TE`` and
    a ``get_dummy_wgrad(shape, dtype, zero=False)`` that keeps one tensor per (shape, dtype)."""
    import torch

    cache: dict = {}

    def get_dummy_wgrad(shape, dtype, zero=False):
        key = (*shape, dtype)
        if key not in cache:
            cache[key] = torch.empty(shape, dtype=dtype, device="cuda")
        if zero:
            cache[key].fill_(0)
        return cache[key].detach()

    layers.HAVE_TE, layers.get_dummy_wgrad = True, get_dummy_wgrad


def child(name: str, emulate: bool) -> dict:
    """One configuration, in this process: build, train, measure."""
    import torch
    import torch.distributed as dist

    from validation.parity import train_gpt_fsdp as gpt_script

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    from megatron.core.distributed import FullyShardedDataParallel
    from megatron.core.tensor_parallel import layers
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    try:
        import transformer_engine.pytorch  # noqa: F401
        spec = "te"
    except ImportError:
        spec = "local"
    if emulate:
        emulate_te_cache(layers)
    tied, fusion, _ = CONFIGS[name]
    m = MODEL
    args = gpt_script.parse_args([
        "--fusion", "on" if fusion else "off", "--main-grads-dtype", "fp32", "--sharding", "optim_grads_params",
        "--tied", "on" if tied else "off", "--spec", spec, "--layers", str(m["layers"]), "--hidden", str(m["hidden"]),
        "--vocab", str(m["vocab"]), "--seq", str(m["seq"]), "--micro-batch-size", str(m["micro_batch_size"])])
    run = gpt_script.expand_plan(args)[0]
    gpt_script.init_parallel(run)
    gpt_script.install_mesh_helper_if_no_einops()
    tconfig, ddp_config, _ = gpt_script.build_configs(run)
    if spec == "local":  # build_configs' local spec is for CPU dry runs: fusion off, CPU init
        import dataclasses

        tconfig = dataclasses.replace(tconfig, gradient_accumulation_fusion=fusion, use_cpu_initialization=False)
    torch.manual_seed(run["seed"])
    model_parallel_cuda_manual_seed(run["seed"])
    gpt = gpt_script.build_gpt(run, tconfig).cuda()
    model = FullyShardedDataParallel(config=tconfig, ddp_config=ddp_config, module=Float16Module(tconfig, gpt))
    data = gpt_script.PatternData(run["vocab"], run["seq"], run["seed"])
    position_ids = torch.arange(run["seq"], device="cuda").unsqueeze(0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = []
    for step in range(1, STEPS + 1):
        model.zero_grad_buffer()
        batch = data.global_batch(step, MICRO_BATCHES).cuda()
        for i in range(MICRO_BATCHES):
            tokens = batch[i:i + 1]
            loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float().mean()
            loss.backward()
            del loss
        model.finish_grad_sync()
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
    gp = sys.modules.get("gemm_patch")
    reason = next((t.reason for t in gp.status().targets if t.name == "fsdp-wgrad"), None) if gp else None
    result = {"name": name, "spec": spec, "emulated_te_cache": emulate, "held_bytes": held,
              "peak_bytes": torch.cuda.max_memory_allocated(), "fsdp_wgrad": reason}
    model.stop_communication()
    dist.destroy_process_group()
    return result


def launch(name: str, port: int, folder: Path, pythonpath: str | None, emulate: bool):
    _, fusion, extra = CONFIGS[name]
    out, log = folder / f"{port}.json", folder / f"{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH")}
    env.update(extra, MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, __file__, "--child", name, "--child-out", str(out), *(["--emulate-te-cache"] * emulate)]
    if fusion:
        cmd = [sys.executable, "-m", "gemm_patch", "run", "--", *cmd]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT), out, log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for the runs' JSON and logs (default: a temporary one)")
    p.add_argument("--pythonpath", default=None, help="put this folder (a megatron-core release) first")
    p.add_argument("--emulate-te-cache", action="store_true",
                   help="without TE: megatron's layers get a get_dummy_wgrad that caches per shape as TE's does")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        Path(args.child_out).write_text(json.dumps(child(args.child, args.emulate_te_cache)))
        return 0

    folder = Path(args.out or tempfile.mkdtemp(prefix="tied_dummy_memory_"))
    folder.mkdir(parents=True, exist_ok=True)
    start = time.time()
    procs = {name: launch(name, 29600 + i, folder, args.pythonpath, args.emulate_te_cache)
             for i, name in enumerate(CONFIGS)}
    for proc, _, _ in procs.values():
        proc.wait(timeout=max(1.0, args.timeout - (time.time() - start)))
    results = {}
    for name, (proc, out, log) in procs.items():
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"{name}: exit {proc.returncode}; its log ({log}) ends:\n{log.read_text()[-3000:]}")
        results[name] = json.loads(out.read_text())
    first = next(iter(results.values()))
    print(f"model {MODEL}, {STEPS} steps x {MICRO_BATCHES} micro-batches, {first['spec']} layers"
          f"{', TE cache emulated' if first['emulated_te_cache'] else ''}; one bf16 output-layer tensor = "
          f"{MODEL['vocab'] * MODEL['hidden'] * 2 / MIB:.0f} MiB; {time.time() - start:.0f} s; files in {folder}")
    print(f"{'configuration':48} {'held MiB':>9} {'peak MiB':>9} {'held - off':>10} {'peak - off':>10}")
    ok = True
    for name, r in results.items():
        off = results[f"{name.split()[0]} fusion off"]
        held, peak = r["held_bytes"][-1] - off["held_bytes"][-1], r["peak_bytes"] - off["peak_bytes"]
        print(f"{name:48} {r['held_bytes'][-1] / MIB:9.0f} {r['peak_bytes'] / MIB:9.0f} "
              f"{held / MIB:10.0f} {peak / MIB:10.0f}")
        if name.endswith("gemm-patch"):
            ok &= held <= TOLERANCE and peak <= TOLERANCE
    print(f"fsdp-wgrad: {results['tied gemm-patch']['fsdp_wgrad']}")
    print(("PASS" if ok else "FAIL") + ": gemm-patch held and peak memory <= fusion off + 0.05 GiB, tied and untied")
    (folder / "summary.json").write_text(json.dumps({"model": MODEL, "results": results, "pass": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
