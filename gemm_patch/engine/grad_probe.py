"""A read-only gradient probe: with ``GEMM_PATCH_GRAD_PROBE=FOLDER`` set, record every parameter's
reduced gradient right after each of the first two calls of megatron-core's
``finalize_model_grads`` in a process (the end of a step's gradient reduction: the data-parallel
reduce, the tied-embedding and layer-norm all-reduces, the per-token scaling), one file per rank
and call in ``FOLDER``. Each record also says the gradient-accumulation fusion setting of the model
chunks' configuration (``fusion``): what the model ran with, whatever the framework printed.

Each record says which step it is of: ``call`` (1 or 2 in its process), ``iteration`` (megatron's
training iteration, where megatron.training's arguments are set; None elsewhere, e.g. under
Megatron-Bridge) and ``process`` (pid, start time, the launcher's restart count). A worker that a
launcher restarts (torchrun ``--max-restarts``, a requeue) starts its own count: its records are
files of their own, and ``by_iteration`` places them by iteration or leaves them unplaced, never
over the first process's.
``gemm-patch compare`` sets it in both of its runs (the fusion-off run too, with every patch off:
the probe is installed even where ``GEMM_PATCH=0``) and judges each parameter.

Why there: ``finalize_model_grads`` is the one function of megatron-core 0.14-0.19 that every
training loop calls (megatron's ``train_step``, Megatron-Bridge, NeMo through
``config.finalize_model_grads_func``) with the model chunks in hand, after every reduction and
before the optimizer reads, clips or unscales anything. Wrapping it when its module is imported
(before ``megatron.core.distributed`` re-exports it) is enough for every caller.

What is recorded per parameter (named as ``chunk.named_parameters()`` names it): the gradient's
norm and ``PROJECTIONS`` checksums, each the sum of the gradient's elements times a fixed
pseudo-random sign of the element's index in the parameter. The gradient read is ``main_grad``
(megatron's fp32 buffer) or ``grad``. Where megatron's distributed optimizer reduce-scatters a
bucket, each rank holds a valid shard of the bucket only: each rank adds up the squares and the
signed sums over the part of the parameter inside its shard, and a sum over the bucket's group
combines them; a bucket reduced by all-reduce is counted on the group's first rank only. A gradient
that is a DTensor (Megatron-FSDP's parameters, after ``finish_grad_sync`` has attached the reduced
shards) is recorded as this rank's block of it (``blocks`` says how many of its rows): both of
compare's runs shard alike, and compare pairs records by rank. No collective is made for it: one
that ran on one rank and not on another (a failure, a gradient one rank lacks) would hang the job.
Ranks of other groups (tensor, pipeline) record their own parameters.

Read-only: nothing it does writes to a tensor of the model or changes an argument or a result;
a failure is recorded (``error``) and the training goes on. Without the variable nothing is
installed (``install`` is not called). The one exception is asked for separately:
``GEMM_PATCH_GRAD_PROBE_PERTURB=R`` (compare's reference runs) multiplies each element of every
gradient by 1 + R or 1 - R (a fixed pseudo-random sign per element) right after the first step's
record, a rounding-sized difference such as fusion on and off make, so that such a run parts from
its twin as a correct fused run would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ENV = "GEMM_PATCH_GRAD_PROBE"
PERTURB_ENV = "GEMM_PATCH_GRAD_PROBE_PERTURB"
STEPS = 2  # the calls recorded in each process
STEP2 = "step2"  # where records that do not say their call were written after the second
SCHEMA = 2
# Where a launcher says how often it has restarted this worker (torchrun, Slurm).
RESTART_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
MODULE = "megatron.core.distributed.finalize_model_grads"
PROJECTIONS = 8
_PRIME = 2147483647
_MULTIPLIERS = (48271, 69621, 16807, 39373, 950706376, 742938285, 1226874159, 62089911)
_CHUNK = 1 << 22

_calls = 0
_started = time.time()  # imported at the process's start-up: what tells its records from a restart's


def requested() -> str | None:
    return os.environ.get(ENV) or None


def install() -> None:
    """Wrap finalize_model_grads when its module is imported (at once if it is already)."""
    import sys

    import wrapt

    if MODULE in sys.modules:
        _wrap(sys.modules[MODULE])
    else:
        wrapt.register_post_import_hook(_wrap, MODULE)


def _wrap(module: Any) -> None:
    import wrapt

    if isinstance(getattr(module, "finalize_model_grads", None), wrapt.FunctionWrapper):
        return
    wrapt.wrap_function_wrapper(module, "finalize_model_grads", _after_first_reduction)


def _after_first_reduction(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    global _calls
    result = wrapped(*args, **kwargs)
    if _calls < STEPS:
        _calls += 1
        model = args[0] if args else kwargs.get("model")
        chunks = model if isinstance(model, (list, tuple)) else [model]
        folder = requested()
        if folder:
            write(folder, {**record(chunks), **identity(_calls, megatron_iteration())})
        if _calls == 1 and perturbation():
            perturb(chunks, perturbation())
    return result


def megatron_iteration() -> int | None:
    """The iteration megatron's training loop is in, where megatron.training's arguments are set
    (``curr_iteration`` counts the steps done before this one); None elsewhere. Only read: the
    module is not imported here."""
    module = sys.modules.get("megatron.training.global_vars")
    done = getattr(getattr(module, "_GLOBAL_ARGS", None), "curr_iteration", None)
    return done + 1 if isinstance(done, int) and not isinstance(done, bool) and done >= 0 else None


def identity(call: int, iteration: int | None) -> dict[str, Any]:
    """What places a record: its call in this process, its iteration (None where unknown) and the
    process."""
    process = {"pid": os.getpid(), "started": _started,
               **{name: os.environ[name] for name in RESTART_VARIABLES if name in os.environ}}
    return {"call": call, "iteration": iteration, "process": process}


def perturbation() -> float:
    """``GEMM_PATCH_GRAD_PROBE_PERTURB`` as a number (0 where unset or not a positive number)."""
    try:
        value = float(os.environ.get(PERTURB_ENV, "0"))
    except ValueError:
        return 0.0
    return value if 0 < value < 1 else 0.0


def perturb(chunks: Iterable[Any], size: float) -> None:
    """Each gradient element times 1 + size or 1 - size, the sign a fixed pseudo-random one of
    its index in the parameter (the same on every rank holding it); never raises."""
    try:
        for _, _, param in _named_parameters(chunks):
            grad = None if type(param).__name__ == "DTensor" else getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is None:
                continue
            local = grad.to_local() if type(grad).__name__ == "DTensor" else grad
            flat = local.detach().view(-1)
            for lo in range(0, flat.numel(), _CHUNK):
                part = flat[lo:lo + _CHUNK]
                part.mul_((1 + size * _signs(lo, lo + part.numel(), 0, part.device)).to(part.dtype))
    except Exception:  # a reference run that could not be perturbed is still a reference
        pass


def _fusion(chunks: Iterable[Any]) -> list[Any]:
    """Each chunk's ``config.gradient_accumulation_fusion`` (None where it has none)."""
    out = []
    for chunk in chunks:
        config = getattr(chunk, "config", None) or getattr(getattr(chunk, "module", None), "config", None)
        value = getattr(config, "gradient_accumulation_fusion", None)
        out.append(value if isinstance(value, bool) else None)
    return out


def _signs(start: int, stop: int, k: int, device: Any) -> Any:
    """The pseudo-random signs (+1/-1, float64) of elements start..stop-1 for projection k."""
    import torch

    index = torch.arange(start, stop, dtype=torch.int64, device=device) % _PRIME
    hashed = (index * _MULTIPLIERS[k] + 7919 * k + 1) % _PRIME
    return ((hashed >> 11) & 1).to(torch.float64) * 2 - 1


def contribution(flat: Any, start: int) -> Any:
    """[sum of squares, PROJECTIONS signed sums] of ``flat``, the elements start.. of a parameter."""
    import torch

    out = torch.zeros(1 + PROJECTIONS, dtype=torch.float64, device=flat.device)
    for lo in range(0, flat.numel(), _CHUNK):
        part = flat[lo:lo + _CHUNK].to(torch.float64)
        out[0] += (part * part).sum()
        for k in range(PROJECTIONS):
            out[1 + k] += (part * _signs(start + lo, start + lo + part.numel(), k, part.device)).sum()
    return out


def _bucket_of(chunk: Any, param: Any) -> tuple[Any, Any] | None:
    """(bucket, bucket group) holding ``param`` in megatron's DistributedDataParallel, or None."""
    group = getattr(chunk, "param_to_bucket_group", {}).get(param)
    for bucket in getattr(group, "buckets", ()):
        if param in getattr(bucket, "params", ()):
            return bucket, group
    return None


def _local_part(chunk: Any, param: Any, grad: Any) -> tuple[Any, int, Any]:
    """(the part of a plain tensor gradient this rank counts, its start in the parameter, the group
    to sum over or None)."""
    import torch.distributed as dist

    flat = grad.detach().reshape(-1)
    found = _bucket_of(chunk, param)
    if found is None or not dist.is_initialized():
        return flat, 0, None
    bucket, group = found
    if getattr(getattr(group, "ddp_config", None), "use_distributed_optimizer", False):
        comm = group.intra_distributed_optimizer_instance_group
        size, rank = dist.get_world_size(comm), dist.get_rank(comm)
        data = bucket.grad_data
        shard = data.numel() // size
        offset = (flat.data_ptr() - data.data_ptr()) // flat.element_size()
        lo, hi = max(0, rank * shard - offset), min(flat.numel(), (rank + 1) * shard - offset)
        return flat[lo:max(lo, hi)], lo, comm
    comm = getattr(bucket, "data_parallel_group", None) or group.data_parallel_group
    return (flat if dist.get_rank(comm) == 0 else flat[:0]), 0, comm


def _named_parameters(chunks: Iterable[Any]) -> list[tuple[str, Any, Any]]:
    chunks = list(chunks)
    seen, out = set(), []
    for i, chunk in enumerate(chunks):
        prefix = f"chunk{i}." if len(chunks) > 1 else ""
        for name, param in chunk.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                out.append((prefix + name, chunk, param))
    return out


def _gemm_patch_state() -> dict[str, Any]:
    from . import config
    from .patcher import status

    st = status()
    return {"enabled": config.enabled(), "applied": st.applied,
            "targets": {t.name: t.state for t in st.targets}}


def record(chunks: Iterable[Any]) -> dict[str, Any]:
    """The probe's record of this rank (never raises: a failure is its ``error``, or a parameter's
    entry under ``not_recorded``)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    out: dict[str, Any] = {"schema": SCHEMA, "rank": rank, "hook": f"{MODULE}.finalize_model_grads",
                           "projections": PROJECTIONS, "parameters": {}, "without_gradient": [],
                           "not_recorded": {}, "blocks": {}}
    try:
        chunks = list(chunks)
        out["fusion"] = _fusion(chunks)
        out["gemm_patch"] = _gemm_patch_state()
        # rows[i] = [name, numel, contribution]; by_group: id -> (group, [row indices]) for the sums
        rows: list[list[Any]] = []
        by_group: dict[int, tuple[Any, list[int]]] = {}
        for name, chunk, param in _named_parameters(chunks):
            grad = None if type(param).__name__ == "DTensor" else getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is None:
                out["without_gradient"].append(name)
                continue
            if type(grad).__name__ == "DTensor":
                local = grad.to_local().detach()
                out["blocks"][name] = {"rows": local.shape[0] if local.dim() else 1,
                                       "of": grad.shape[0] if grad.dim() else 1}
                rows.append([name, local.numel(), _contribution_or_zeros(out, name, local.reshape(-1), 0)])
                continue
            part, start, comm = _local_part(chunk, param, grad)
            rows.append([name, param.numel(), _contribution_or_zeros(out, name, part, start)])
            by_group.setdefault(id(comm), (comm, []))[1].append(len(rows) - 1)
        for comm, indices in by_group.values():
            if comm is None:
                continue
            stacked = torch.stack([rows[i][2] for i in indices])
            dist.all_reduce(stacked, group=comm)
            for j, i in enumerate(indices):
                rows[i][2] = stacked[j]
        for name, numel, values in rows:
            if name in out["not_recorded"]:
                continue
            values = values.cpu().tolist()
            out["parameters"][name] = {"numel": numel, "norm": max(values[0], 0.0) ** 0.5,
                                       "projections": values[1:]}
    except Exception as exc:  # read-only and never fatal: the record says what went wrong
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _contribution_or_zeros(out: dict[str, Any], name: str, flat: Any, start: int) -> Any:
    """contribution(flat, start), or zeros with the parameter listed under ``not_recorded`` where
    it fails on this rank (its sums still take part in the group's collective)."""
    import torch

    try:
        return contribution(flat, start)
    except Exception as exc:
        out["not_recorded"][name] = f"{type(exc).__name__}: {exc}"
        return torch.zeros(1 + PROJECTIONS, dtype=torch.float64, device=getattr(flat, "device", None))


def write(folder: str, rec: dict[str, Any]) -> None:
    """``rec`` into a file of its own: named by rank, call and process, so that no process's
    record replaces another's."""
    process = rec.get("process") or {}
    name = f"rank{rec['rank']}.call{rec.get('call', 1)}.{process.get('pid', 0)}-{process.get('started', 0.0):.6f}.json"
    try:
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(json.dumps(rec) + "\n")
    except OSError:
        pass


def read(folder: str) -> list[dict[str, Any]]:
    """Every record in ``folder`` (empty where there are none). A record that does not say its
    call (``FOLDER/rank<R>.json`` and ``FOLDER/step2/rank<R>.json``, as records were written
    before they said it) gets 1 or 2 by where it lies."""
    out = []
    for where, call in ((Path(folder), 1), (Path(folder, STEP2), 2)):
        for path in sorted(where.glob("rank*.json")):
            try:
                rec = json.loads(path.read_text())
                int(rec["rank"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            out.append({**rec, "rank": int(rec["rank"]), "call": rec.get("call", call)})
    return out


def files(folder: str) -> list[Path]:
    """The record files in ``folder``, of either naming."""
    return [*Path(folder).glob("rank*.json"), *Path(folder, STEP2).glob("rank*.json")]


def _process_key(rec: dict[str, Any]) -> tuple[float, int]:
    process = rec.get("process") or {}
    return float(process.get("started") or 0.0), int(process.get("pid") or 0)


def first_processes(records: Iterable[dict[str, Any]]) -> dict[int, tuple[float, int]]:
    """Each rank's first process (the run's start), as the records identify it."""
    first: dict[int, tuple[float, int]] = {}
    for rec in records:
        key = _process_key(rec)
        first[rec["rank"]] = min(key, first.get(rec["rank"], key))
    return first


def later_process(rec: dict[str, Any], first: dict[int, tuple[float, int]]) -> bool:
    """Whether ``rec`` was written by a process of its rank that started after the rank's first
    (``first_processes``): a restarted worker."""
    return _process_key(rec) > first[rec["rank"]]


def by_iteration(records: list[dict[str, Any]]) -> tuple[dict[int, dict[int, dict[str, Any]]], list[dict[str, Any]]]:
    """({iteration: {rank: record}}, the records that cannot be placed). A record is placed at its
    iteration; one that does not say it, at its call where its process is the rank's first (the
    run's start: call 1 is its first step), and nowhere where a later process wrote it (a restart,
    resumed at an iteration unknown here). An iteration recorded twice on a rank (a restart that
    went back to an earlier checkpoint) keeps the first process's record, as compare keeps an
    iteration's first log line."""
    placed: dict[int, dict[int, dict[str, Any]]] = {}
    unplaced = []
    first = first_processes(records)
    for rec in sorted(records, key=lambda r: (_process_key(r), r.get("call", 1))):
        iteration = rec.get("iteration")
        if not isinstance(iteration, int) or isinstance(iteration, bool):
            iteration = None if later_process(rec, first) else rec.get("call", 1)
        if iteration is None:
            unplaced.append(rec)
        else:
            placed.setdefault(iteration, {}).setdefault(rec["rank"], rec)
    return placed, unplaced
