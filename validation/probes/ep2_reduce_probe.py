"""ep2_moe layout: observe how Megatron-FSDP scales and reduces each gradient bucket.

With EP = DP = 2 on 2 GPUs the expert data-parallel group has one rank, and under
``optim_grads_params`` every expert gradient came out 2.000x autograd (validation/notes/layouts.md,
"ep2_moe: expert gradients 2x autograd"). This observer is installed inside the training process
before the model is wrapped (``validation/parity/train_gpt_fsdp.py --reduce-probe PATH``) and records, per
buffer / bucket and per call: expert or not, ``gradient_scaling_factor``, the group's size,
``is_data_distributed``, whether ``fetch_bucket`` handed out the persistent buffer itself, the
reduce op ``gradient_reduce_preprocessing`` chose, the collective issued (name, group size, op,
in place or not), and the bucket's fp64 gradient norm before the preprocessing, after it and
after the collective has completed (``torch.cuda.synchronize()``). It changes no value; the
synchronize after each bucket group only serialises the reduce stream.

Every wrap uses ``functools.wraps`` and is undone exactly by ``uninstall()`` (the original
object is put back into the owner's ``__dict__``, or the attribute deleted when it was
inherited). A name missing from a release is recorded under ``missing`` and skipped.

Observed functions (line numbers: megatron-core 0.17.1 / 0.19.2, file
megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py unless said):
  * ``ParamAndGradBuffer._init_each_parameter_group_buffers`` (:1918 / :2317): picks
    ``gradient_scaling_factor`` per group (``expert_gradient_scaling_factor`` for expert groups,
    :2196-2200 / :2617-2621) and ``is_data_distributed=... and main_buf_dp_group.size() > 1``
    (:2302 / :2711). Recorded after it returns: one ``buffer`` event per parameter group.
  * ``DataParallelBuffer.fetch_bucket`` (:938 / :1291): a non-distributed buffer of the buffer's
    own dtype hands out its persistent data (:958-965 / :1323-1330). Recorded (inside a reduce
    only): whether the returned bucket aliases ``gbuf.data``.
  * ``GradReducePipeline._bucket_group_gradient_reduce`` (:3566 / :4005): the per-bucket-group
    reduce of ``overlap_grad_reduce`` (pre-scale :3630-3635 / :4069-4074, all-reduce for no_shard
    :3637-3641 / :4076-4080, reduce-scatter otherwise :3646-3658 / :4085-4097, accumulation
    ``local_grad += reduced_grad`` :3677-3682 / :4116-4121), all under one
    ``_coalescing_manager`` of the FIRST bucket's group (:3597-3599 / :4036-4038).
  * ``ParamAndGradBuffer.reduce_scatter_gradients`` (:3176 / :3611) and ``all_reduce_gradients``
    (:3212 / :3647): the non-overlapped path (megatron_fsdp.py :1230-1236 / :1308-1314; note
    megatron_fsdp.py :288-294 / :331-337 force overlap_grad_reduce on for optim_grads(_params)).
  * module function ``gradient_reduce_preprocessing`` (:4254 / :4732): SUM without a factor,
    AVG with average_in_collective, PreMulSum when gradient_reduce_div_fusion and not bf16, else
    an explicit ``mul_`` then SUM. Called by module-global lookup at :3632 / :4071, :3197 / :3632,
    :3237 / :3672, so replacing the module attribute observes every call.
  * ``torch.distributed.reduce_scatter_tensor`` / ``all_reduce`` (called as attributes of
    ``torch.distributed`` at :3639, :3653 / :4078, :4092 and :3198, :3238 / :3633, :3673):
    recorded only while one of the reduce functions above is running.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

PGB_MODULE = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
# (owner attribute in the module, or None for a module-level function; name)
PGB_TARGETS = (
    ("ParamAndGradBuffer", "_init_each_parameter_group_buffers"),
    ("DataParallelBuffer", "fetch_bucket"),
    ("GradReducePipeline", "_bucket_group_gradient_reduce"),
    ("ParamAndGradBuffer", "reduce_scatter_gradients"),
    ("ParamAndGradBuffer", "all_reduce_gradients"),
    (None, "gradient_reduce_preprocessing"),
)
COLLECTIVES = ("reduce_scatter_tensor", "all_reduce")
_MISSING = object()


def _norm(t) -> float | None:
    try:
        import torch

        return float(torch.linalg.vector_norm(t.detach(), dtype=torch.float64))
    except Exception:  # noqa: BLE001 - a diagnostic: never stop training
        return None


def _size(group) -> int | None:
    try:
        return int(group.size())
    except Exception:  # noqa: BLE001
        return None


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class ReduceProbe:
    """Install with ``install()`` before the model is wrapped; ``write(path)`` at the end."""

    def __init__(self, max_events: int = 400) -> None:
        self.max_events = max_events
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self.missing: list[str] = []
        self.wrapped: list[str] = []
        self.errors: list[str] = []
        self.run = None
        self.step = 0
        self.micro = 0
        self._undo: list[tuple[Any, str, Any]] = []
        self._gbufs: dict[int, dict[str, Any]] = {}  # id(gbuf) -> {"bucket", "expert"}
        self._ctx: dict[str, Any] | None = None  # the reduce now running
        self._summary: dict[str, dict[str, Any]] = {}

    # -- bookkeeping ---------------------------------------------------------------------------
    def set_run(self, name: str) -> None:
        """A new configuration of a --plan process: new buffers (ids may be reused after GC)."""
        self.run, self.step, self.micro = name, 0, 0
        self._gbufs.clear()

    def set_step(self, step: int) -> None:
        self.step, self.micro = step, 0

    def next_micro(self) -> None:
        self.micro += 1

    def _emit(self, event: dict[str, Any]) -> None:
        if len(self.events) < self.max_events:
            self.events.append({"run": self.run, **event})
        else:
            self.dropped += 1

    def _error(self, where: str, exc: BaseException) -> None:
        if len(self.errors) < 20:
            self.errors.append(f"{where}: {type(exc).__name__}: {exc}")

    # -- install / uninstall -------------------------------------------------------------------
    def _wrap(self, owner, name: str, label: str, make) -> None:
        if owner is None or not hasattr(owner, name):
            self.missing.append(label)
            return
        original = owner.__dict__.get(name, _MISSING)
        func = getattr(owner, name)
        wrapper = functools.wraps(func)(make(func))
        self._undo.append((owner, name, original))
        setattr(owner, name, wrapper)
        self.wrapped.append(label)

    def install(self, pgb=None, dist=None) -> ReduceProbe:
        """Wrap the observed functions of ``pgb`` (default: the Megatron-FSDP module of the
        megatron-core on sys.path) and ``dist`` (default: torch.distributed)."""
        if self._undo:
            raise RuntimeError("ReduceProbe already installed")
        if pgb is None:
            import importlib

            try:
                pgb = importlib.import_module(PGB_MODULE)
            except Exception as exc:  # noqa: BLE001
                self.missing.append(f"{PGB_MODULE} ({type(exc).__name__}: {exc})")
                return self
        if dist is None:
            import torch.distributed as dist
        makers = {
            "_init_each_parameter_group_buffers": self._make_init,
            "fetch_bucket": self._make_fetch,
            "_bucket_group_gradient_reduce": self._make_bucket_group,
            "reduce_scatter_gradients": functools.partial(self._make_whole, "reduce_scatter_gradients"),
            "all_reduce_gradients": functools.partial(self._make_whole, "all_reduce_gradients"),
            "gradient_reduce_preprocessing": self._make_preprocessing,
        }
        for owner_name, name in PGB_TARGETS:
            owner = pgb if owner_name is None else getattr(pgb, owner_name, None)
            label = f"{owner_name}.{name}" if owner_name else name
            self._wrap(owner, name, label, makers[name])
        for name in COLLECTIVES:
            self._wrap(dist, name, f"torch.distributed.{name}", functools.partial(self._make_collective, name))
        return self

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._undo):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._undo.clear()

    # -- wrappers ------------------------------------------------------------------------------
    def _make_init(self, func):
        def wrapper(buf, *args, **kwargs):
            out = func(buf, *args, **kwargs)
            try:
                self._record_buffers(buf)
            except Exception as exc:  # noqa: BLE001
                self._error("buffers", exc)
            return out
        return wrapper

    def _record_buffers(self, buf) -> None:
        ddp = getattr(buf, "ddp_config", None)
        self._emit({"ev": "factors", "gradient_scaling_factor": getattr(buf, "gradient_scaling_factor", None),
                    "expert_gradient_scaling_factor": getattr(buf, "expert_gradient_scaling_factor", None),
                    **{k: getattr(ddp, k, None) for k in (
                        "data_parallel_sharding_strategy", "overlap_grad_reduce", "gradient_reduce_div_fusion",
                        "average_in_collective", "fsdp_double_buffer", "outer_dp_sharding_strategy")}})
        for gid, group in enumerate(getattr(buf, "parameter_groups", None) or []):
            gbuf = getattr(group, "main_grad_buffer", None)
            expert = bool(getattr(group, "is_expert_param", False))
            if gbuf is not None:
                self._gbufs[id(gbuf)] = {"bucket": gid, "expert": expert}
            self._emit({"ev": "buffer", "bucket": gid, "expert": expert, "n_params": len(group.params),
                        "fsdp_unit": getattr(group, "fsdp_unit_id", None), "grad_buffer": gbuf is not None,
                        **(self._gbuf_meta(gbuf) if gbuf is not None else {})})

    @staticmethod
    def _gbuf_meta(gbuf) -> dict[str, Any]:
        return {"scale": getattr(gbuf, "gradient_scaling_factor", None),
                "group_size": _size(getattr(gbuf, "data_parallel_group", None)),
                "distributed": getattr(gbuf, "is_data_distributed", None),
                "dtype": str(getattr(gbuf, "dtype", None)),
                "numel": int(gbuf.data.numel()) if getattr(gbuf, "data", None) is not None else None}

    def _make_fetch(self, func):
        def wrapper(gbuf, *args, **kwargs):
            bucket = func(gbuf, *args, **kwargs)
            ctx = self._ctx
            if ctx is not None:
                try:
                    data, local = bucket.data, gbuf.data
                    ctx["fetched"] = {"aliases_local": data.data_ptr() == local.data_ptr()
                                      and data.numel() == local.numel(), "dtype": str(data.dtype)}
                except Exception as exc:  # noqa: BLE001
                    self._error("fetch_bucket", exc)
            return bucket
        return wrapper

    def _begin(self, path: str, gbufs: list[tuple[int, Any]], **extra) -> dict[str, Any]:
        ctx = {"path": path, "gbufs": gbufs, "i": 0, "fetched": None, "records": [], **extra}
        for bid, gbuf in gbufs:
            info = self._gbufs.get(id(gbuf), {})
            ctx["records"].append({
                "ev": "reduce", "path": path, "step": self.step, "micro": self.micro, "bucket": bid,
                "expert": info.get("expert"), **self._gbuf_meta(gbuf), "norm_local_before": _norm(gbuf.data)})
        return ctx

    def _end(self, ctx: dict[str, Any]) -> None:
        _sync()  # the reduce stream's (and NCCL's) work done before the norms are read
        for rec, (_, gbuf) in zip(ctx["records"], ctx["gbufs"], strict=True):
            rec["norm_local_after"] = _norm(gbuf.data)
            b, a = rec.get("norm_local_before"), rec["norm_local_after"]
            rec["ratio_local"] = (a / b) if a is not None and b else None
            self._emit(rec)
            kind = "expert" if rec["expert"] else "dense"
            key = f"{self.run}.step{rec['step']}.micro{rec['micro']}.{kind}.{rec['path']}"
            s = self._summary.setdefault(key, {"buckets": 0, "sq_before": 0.0, "sq_after": 0.0})
            s["buckets"] += 1
            s["sq_before"] += (b or 0.0) ** 2
            s["sq_after"] += (a or 0.0) ** 2

    def _run_observed(self, ctx_factory, func, args, kwargs):
        ctx = None
        try:
            ctx = ctx_factory()
        except Exception as exc:  # noqa: BLE001
            self._error("begin", exc)
        outer, self._ctx = self._ctx, ctx
        try:
            return func(*args, **kwargs)
        finally:
            self._ctx = outer
            if ctx is not None:
                try:
                    self._end(ctx)
                except Exception as exc:  # noqa: BLE001
                    self._error("end", exc)

    def _make_bucket_group(self, func):
        def wrapper(pipeline, bucket_group, *args, **kwargs):
            def ctx():
                gbufs = [(b, pipeline.get_fsdp_buffer(b)) for b in bucket_group]
                return self._begin("bucket_group", gbufs, coalescing_group_size=_size(gbufs[0][1].data_parallel_group)
                                   if gbufs else None)
            return self._run_observed(ctx, func, (pipeline, bucket_group, *args), kwargs)
        return wrapper

    def _make_whole(self, path: str, func):
        def wrapper(buf, *args, **kwargs):
            def ctx():
                gbufs = [(i, g.main_grad_buffer) for i, g in enumerate(buf.parameter_groups)
                         if g.main_grad_buffer is not None]
                return self._begin(path, gbufs)
            return self._run_observed(ctx, func, (buf, *args), kwargs)
        return wrapper

    def _make_preprocessing(self, func):
        def wrapper(grad_data, scaling_factor, ddp_config, *args, **kwargs):
            ctx = self._ctx
            rec = None
            if ctx is not None and ctx["i"] < len(ctx["records"]):
                rec = ctx["records"][ctx["i"]]
                ctx["i"] += 1
                rec.update(pre_scale=scaling_factor, fetched=ctx["fetched"], norm_bucket_in=_norm(grad_data))
                ctx["fetched"] = None
            op = func(grad_data, scaling_factor, ddp_config, *args, **kwargs)
            if rec is not None:
                rec.update(op=repr(op), norm_bucket_preprocessed=_norm(grad_data))
                ctx["current"] = rec
            return op
        return wrapper

    def _make_collective(self, name: str, func):
        def wrapper(*args, **kwargs):
            ctx = self._ctx
            if ctx is not None and ctx.get("current") is not None:
                try:
                    rec, ctx["current"] = ctx["current"], None
                    out = kwargs.get("output", args[0] if args else None)
                    inp = kwargs.get("input", args[1] if len(args) > 1 else None) if name != "all_reduce" else out
                    in_place = (out is not None and inp is not None and inp.data_ptr() <= out.data_ptr()
                                < inp.data_ptr() + inp.numel() * inp.element_size())
                    rec["collective"] = {"name": name, "group_size": _size(kwargs.get("group")),
                                         "op": repr(kwargs.get("op")), "in_place": in_place,
                                         "async_op": kwargs.get("async_op")}
                except Exception as exc:  # noqa: BLE001
                    self._error(name, exc)
            return func(*args, **kwargs)
        return wrapper

    # -- output --------------------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        summary = {k: {"buckets": v["buckets"], "norm_before": v["sq_before"] ** 0.5,
                       "norm_after": v["sq_after"] ** 0.5,
                       "ratio": (v["sq_after"] / v["sq_before"]) ** 0.5 if v["sq_before"] else None}
                   for k, v in self._summary.items()}
        reduced = {e["bucket"] for e in self.events if e.get("ev") == "reduce" and e.get("run") == self.run}
        never = sorted(info["bucket"] for info in self._gbufs.values() if info["bucket"] not in reduced)
        return {"schema": "gemm_patch.ep2_reduce_probe/1", "wrapped": self.wrapped, "missing": self.missing,
                "errors": self.errors, "dropped_events": self.dropped, "summary": summary,
                "buckets_never_reduced_last_run": never, "events": self.events}

    def write(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(dumps(self.as_dict()))


def dumps(obj: Any) -> str:
    """JSON with one event a line."""
    return json.dumps(obj, default=repr).replace("}, {", "},\n {")
