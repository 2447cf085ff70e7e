"""validation/probes/ep2_reduce_probe.py (the ep2_moe layout's pinning probe): installs and uninstalls
exactly on both real megatron-core releases' Megatron-FSDP module (imported on the CPU in a
subprocess with compat/.cache/mcore-X on PYTHONPATH), records norms around the real
``gradient_reduce_preprocessing``, and stays out of train_gpt_fsdp.py unless asked for."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from compat import matrix  # compat/matrix.py installs a release from PyPI on first use

ROOT = Path(__file__).resolve().parents[2]

PROBES = ROOT / "validation" / "probes"
PARITY = ROOT / "validation" / "parity"
RELEASES = ("0.17.1", "0.19.2")

torch = pytest.importorskip("torch")
from validation.probes import ep2_reduce_probe  # noqa: E402

# Runs in a subprocess under one release: install, check every wrap, exercise the real
# gradient_reduce_preprocessing (explicit mul_ path) inside a fake bucket-group reduce, uninstall.
CHILD = r"""
import json, sys, types
import torch
from validation.probes import ep2_reduce_probe as probe_mod
import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as pgb
import torch.distributed as dist

owners = {name: (pgb if owner is None else getattr(pgb, owner)) for owner, name in probe_mod.PGB_TARGETS}
before = {name: owners[name].__dict__.get(name) for name in owners}
before_dist = {n: dist.__dict__[n] for n in probe_mod.COLLECTIVES}
probe = probe_mod.ReduceProbe().install()
swapped = {name: owners[name].__dict__[name] is not before[name]
           and owners[name].__dict__[name].__wrapped__ is before[name] for name in owners}
swapped.update({n: dist.__dict__[n].__wrapped__ is before_dist[n] for n in probe_mod.COLLECTIVES})

# A fake pipeline whose bucket group holds one non-distributed expert buffer: the real
# gradient_reduce_preprocessing (looked up as a module global, as Megatron-FSDP does) scales it.
gbuf = types.SimpleNamespace(data=torch.full((8,), 2.0, dtype=torch.float32), gradient_scaling_factor=0.5,
                             is_data_distributed=False, dtype=torch.float32, data_parallel_group=None)
ddp = types.SimpleNamespace(average_in_collective=False, gradient_reduce_div_fusion=False)
def fake_reduce(self, bucket_group, async_op=False):
    op = pgb.gradient_reduce_preprocessing(self.get_fsdp_buffer(bucket_group[0]).data, 0.5, ddp)
    return op
fake = types.SimpleNamespace(get_fsdp_buffer=lambda b: gbuf)
probe.set_run("fake"); probe.set_step(1); probe.next_micro()
probe._gbufs[id(gbuf)] = {"bucket": 3, "expert": True}  # what the construction wrapper maps
wrapped_reduce = probe._make_bucket_group(fake_reduce)
op = wrapped_reduce(fake, [3])
probe.uninstall()
restored = {name: owners[name].__dict__.get(name) is before[name] for name in owners}
restored.update({n: dist.__dict__[n] is before_dist[n] for n in probe_mod.COLLECTIVES})
print("RESULT" + json.dumps({"missing": probe.missing, "wrapped": probe.wrapped, "swapped": swapped,
                             "restored": restored, "record": probe.as_dict(), "op": repr(op)}))
"""


def _run_release(rel: str) -> dict:
    try:
        tree = matrix.ensure_release(matrix.select([rel])[0])
    except subprocess.CalledProcessError as exc:  # no registry: nothing to test against
        pytest.skip(f"megatron-core {rel} could not be installed: {exc.stderr[-300:]}")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(PROBES)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT"):])


@pytest.mark.parametrize("rel", RELEASES)
def test_installs_and_uninstalls_exactly_on_real_release(rel):
    out = _run_release(rel)
    assert out["missing"] == []
    expected = [f"{o}.{n}" if o else n for o, n in ep2_reduce_probe.PGB_TARGETS]
    expected += [f"torch.distributed.{n}" for n in ep2_reduce_probe.COLLECTIVES]
    assert out["wrapped"] == expected
    assert all(out["swapped"].values()), out["swapped"]
    assert all(out["restored"].values()), out["restored"]
    # The real gradient_reduce_preprocessing ran under the wrapper: explicit mul_ by 0.5.
    rec = [e for e in out["record"]["events"] if e["ev"] == "reduce"]
    assert len(rec) == 1, out["record"]
    e = rec[0]
    norm = 2.0 * 8 ** 0.5
    assert e["expert"] is True and e["bucket"] == 3 and e["step"] == 1 and e["micro"] == 1
    assert e["norm_local_before"] == pytest.approx(norm) and e["norm_bucket_in"] == pytest.approx(norm)
    assert e["norm_bucket_preprocessed"] == pytest.approx(norm / 2)
    assert e["ratio_local"] == pytest.approx(0.5)
    assert "SUM" in e["op"] and e["pre_scale"] == 0.5
    assert out["record"]["summary"]["fake.step1.micro1.expert.bucket_group"]["ratio"] == pytest.approx(0.5)


def test_missing_names_are_recorded_not_raised():
    fake_pgb = types.ModuleType("fake_pgb")
    fake_dist = types.ModuleType("fake_dist")

    def gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config):
        return "SUM"

    fake_pgb.gradient_reduce_preprocessing = gradient_reduce_preprocessing
    probe = ep2_reduce_probe.ReduceProbe().install(pgb=fake_pgb, dist=fake_dist)
    assert probe.wrapped == ["gradient_reduce_preprocessing"]
    assert fake_pgb.gradient_reduce_preprocessing.__wrapped__ is gradient_reduce_preprocessing
    assert "GradReducePipeline._bucket_group_gradient_reduce" in probe.missing
    assert "torch.distributed.reduce_scatter_tensor" in probe.missing
    probe.uninstall()
    assert fake_pgb.gradient_reduce_preprocessing is gradient_reduce_preprocessing


def test_collective_and_fetch_are_attributed_to_the_bucket():
    """Fake module: fetch_bucket returning the persistent buffer, a collective in place."""
    gbuf_data = torch.ones(4, dtype=torch.float64)
    calls = []

    class DataParallelBuffer:
        def fetch_bucket(self, dtype=None):
            return types.SimpleNamespace(data=self.data)

    class GradReducePipeline:
        def _bucket_group_gradient_reduce(self, bucket_group, async_op=False):
            g = self.get_fsdp_buffer(bucket_group[0])
            data = g.fetch_bucket().data
            op = fake_pgb.gradient_reduce_preprocessing(data, 0.5, None)
            fake_dist.reduce_scatter_tensor(output=data, input=data, op=op, group=g.data_parallel_group)

    fake_pgb = types.ModuleType("fake_pgb")
    fake_pgb.DataParallelBuffer, fake_pgb.GradReducePipeline = DataParallelBuffer, GradReducePipeline
    fake_pgb.gradient_reduce_preprocessing = lambda grad, s, cfg: "PREMUL"
    fake_dist = types.ModuleType("fake_dist")
    fake_dist.reduce_scatter_tensor = lambda **kw: calls.append(kw)
    gbuf = DataParallelBuffer()
    gbuf.data, gbuf.gradient_scaling_factor, gbuf.is_data_distributed = gbuf_data, 0.5, False
    gbuf.dtype, gbuf.data_parallel_group = torch.float64, types.SimpleNamespace(size=lambda: 1)
    pipe = GradReducePipeline()
    pipe.get_fsdp_buffer = lambda b: gbuf
    probe = ep2_reduce_probe.ReduceProbe().install(pgb=fake_pgb, dist=fake_dist)
    pipe._bucket_group_gradient_reduce([0])
    probe.uninstall()
    assert len(calls) == 1  # the original collective ran
    (e,) = [x for x in probe.as_dict()["events"] if x["ev"] == "reduce"]
    assert e["fetched"] == {"aliases_local": True, "dtype": "torch.float64"}
    assert e["collective"]["group_size"] == 1 and e["collective"]["in_place"] is True
    assert e["collective"]["op"] == "'PREMUL'" and e["group_size"] == 1 and e["distributed"] is False
    assert e["ratio_local"] == pytest.approx(1.0)  # the fake reduce changed nothing
    assert probe.as_dict()["buckets_never_reduced_last_run"] == []


def test_train_script_imports_probe_only_with_the_flag():
    src = (PARITY / "train_gpt_fsdp.py").read_text()
    tree = ast.parse(src)
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any("ep2_reduce_probe" in ast.unparse(n) for n in top)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    guarded = [n for n in ast.walk(main) if isinstance(n, ast.If) and "args.reduce_probe" in ast.unparse(n.test)]
    assert any("from validation.probes.ep2_reduce_probe import ReduceProbe" in ast.unparse(n) for n in guarded)
    from validation.parity import train_gpt_fsdp

    args = train_gpt_fsdp.parse_args(["--steps", "1"])
    assert args.reduce_probe is None and args.grad_div_fusion is None
    (run,) = train_gpt_fsdp.expand_plan(args)
    assert "grad_div_fusion" not in run  # absent flag: the run's config is unchanged
    (run,) = train_gpt_fsdp.expand_plan(train_gpt_fsdp.parse_args(["--grad-div-fusion", "off"]))
    assert run["grad_div_fusion"] == "off"
