"""Overwrite or accumulate: the fused wgrad under Megatron-FSDP's two kinds of main_grad.

Megatron-FSDP hands the layer ``param.get_main_grad()``, which is either a view of the
persistent gradient buffer (``no_shard``/``optim``, or any strategy on one data-parallel rank:
the buffer sums the step's micro-batches and is reduced once) or a freshly allocated,
unzeroed communication bucket that is reduce-scattered before the next micro-batch (sharded
gradients on more than one rank). The first must be added to, the second overwritten.
``megatron_fsdp_param`` rebuilds the attributes Megatron-FSDP sets on a parameter (see
docs/how-it-works.md for the file:line of each), runs several micro-batches through
megatron's own fused-wgrad autograd function and checks what the buffer ends up holding.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import APPLICABLE, layers, torch

import gemm_patch
from gemm_patch.upstream.fsdp_rules import main_grad_is_persistent

pytestmark = pytest.mark.proves("fsdp-wgrad")

needs_call_site = pytest.mark.skipif(not APPLICABLE, reason="release has no such call site")


class GradBuffer:
    """The part of megatron_fsdp's DataParallelBuffer that ``main_grad_getter`` uses:
    ``fetch_bucket`` returns the buffer's own storage when the data is not distributed and a
    new temporary bucket otherwise (NaN-poisoned here: Megatron-FSDP's allocator does not zero
    it, so a kernel that reads it shows)."""

    def __init__(self, numel: int, dtype, is_data_distributed: bool) -> None:
        self.is_data_distributed = is_data_distributed
        self.dtype = dtype
        self.data = torch.zeros(numel, dtype=dtype)  # zero_grad_buffer() at the step's start
        self.buckets: list[torch.Tensor] = []

    def fetch_bucket(self, dtype=None) -> torch.Tensor:
        if not self.is_data_distributed and (dtype is None or dtype == self.dtype):
            return self.data
        bucket = torch.full_like(self.data, float("nan"))
        self.buckets.append(bucket)
        return bucket


def megatron_fsdp_param(out_features: int, in_features: int, *, distributed: bool,
                        main_dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16))
    gbuf = GradBuffer(weight.numel(), main_dtype, distributed)
    # MegatronFSDP.__init__ and all_gather_and_wait_parameters_ready:
    weight.__fsdp_param__ = True
    weight.grad_added_to_main_grad = False
    weight.overwrite_main_grad = True  # set for every unsharded param of optim_grads_params
    # ParamAndGradBuffer: p._gbuf, p._item_id, p.get_main_grad = main_grad_getter.__get__(p)
    weight._gbuf = gbuf
    weight._item_id = 0
    weight.get_main_grad = lambda: weight._gbuf.fetch_bucket().view(weight.shape)
    return weight, gbuf


def backward_micro_batches(weight, n: int, tokens: int = 48, seed: int = 1):
    """Forward + backward ``n`` micro-batches through megatron's fused-wgrad function, yielding
    each micro-batch's exact weight gradient after its backward."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(tokens, weight.shape[1], generator=gen).to(torch.bfloat16).requires_grad_()
        y = layers.linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False,
            sequence_parallel=False,
        )
        grad_out = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
        y.backward(grad_out)
        yield grad_out.double().t() @ x.detach().double()


def run_micro_batches(weight, n: int, tokens: int = 48, seed: int = 1):
    """``backward_micro_batches`` with the part of Megatron-FSDP's post-backward hook
    (``_grad_acc``) that touches these attributes; returns each micro-batch's exact weight gradient."""
    exact = []
    for grad in backward_micro_batches(weight, n, tokens, seed):
        exact.append(grad)
        assert weight.grad_added_to_main_grad, "the layer did not take the fused path"
        # _grad_acc: the fused path already wrote main_grad; drop the dummy .grad and reset.
        weight.grad = None
        weight.grad_added_to_main_grad = False
    return exact


@pytest.fixture
def cpu_dummy_wgrad(monkeypatch):
    # Without TE, megatron allocates the dummy .grad it returns for a weight carrying
    # grad_added_to_main_grad on torch.cuda.current_device(); this CPU test has no CUDA device.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


@needs_call_site
@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_persistent_buffer_sums_every_micro_batch(patched, cpu_dummy_wgrad, micro_batches):
    """no_shard / one data-parallel rank: before the fix only the last micro-batch survived
    (the 1/sqrt(micro-batches) gradient norms seen on the H200s)."""
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=False)
    exact = run_micro_batches(weight, micro_batches)
    total = sum(exact)
    got = gbuf.data.view(weight.shape)
    assert not torch.isnan(got).any()
    assert rel(got, total) < 1e-6, f"main_grad holds {got.norm():.4g}, the step's sum {total.norm():.4g}"


@needs_call_site
def test_fresh_bucket_is_overwritten_each_micro_batch(patched, cpu_dummy_wgrad):
    """Sharded gradients on several ranks: each micro-batch gets an unzeroed bucket that is
    reduce-scattered before the next; it must hold exactly that micro-batch's gradient."""
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=True)
    exact = run_micro_batches(weight, 3)
    assert len(gbuf.buckets) == 3
    for bucket, ref in zip(gbuf.buckets, exact, strict=True):
        got = bucket.view(weight.shape)
        assert not torch.isnan(got).any(), "accumulated onto the bucket's stale contents"
        assert rel(got, ref) < 1e-6
    assert torch.count_nonzero(gbuf.data) == 0, "the persistent buffer must not be touched"


@needs_call_site
def test_bf16_persistent_buffer_accumulates_like_apex(patched, cpu_dummy_wgrad):
    weight, gbuf = megatron_fsdp_param(40, 32, distributed=False, main_dtype=torch.bfloat16)
    exact = run_micro_batches(weight, 3)
    assert rel(gbuf.data.view(weight.shape), sum(exact)) < 2 ** -7


def test_rule_reads_only_megatron_fsdp_attributes():
    plain = torch.nn.Parameter(torch.zeros(2, 2))
    assert main_grad_is_persistent(plain) is False  # not Megatron-FSDP: overwrite
    persistent, _ = megatron_fsdp_param(2, 2, distributed=False)
    fresh, _ = megatron_fsdp_param(2, 2, distributed=True)
    assert main_grad_is_persistent(persistent) is True
    assert main_grad_is_persistent(fresh) is False
    # overwrite_main_grad is set to True by Megatron-FSDP in both cases: it cannot decide.
    assert persistent.overwrite_main_grad and fresh.overwrite_main_grad


def _megatron_fsdp_source(name: str) -> str | None:
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "distributed/fsdp/src/megatron_fsdp" / name
    return path.read_text() if path.exists() else None


def test_release_still_has_the_contract_the_rule_reads():
    """The rule is only as good as these lines of the release under test; a release that
    changes them must fail here rather than silently get the wrong accumulate flag."""
    buffer_src = _megatron_fsdp_source("param_and_grad_buffer.py")
    if buffer_src is None:
        pytest.skip("this megatron-core release has no Megatron-FSDP")
    assert "p._gbuf = " in buffer_src
    assert "p.get_main_grad = main_grad_getter.__get__(p)" in buffer_src
    assert "fetch_bucket(" in buffer_src.split("def main_grad_getter", 1)[1][:1500]
    assert "if not self.is_data_distributed and dtype == self.dtype:" in buffer_src


def test_unpatched_release_overwrites_the_persistent_buffer(cpu_dummy_wgrad):
    """Documents the upstream behaviour the fix departs from (where upstream can run at all:
    with an fp32 buffer the unpatched call crashes, with bf16 it overwrites)."""
    if not APPLICABLE:
        pytest.skip("release has no such call site")
    gemm_patch.revert()
    try:
        weight, gbuf = megatron_fsdp_param(40, 32, distributed=False, main_dtype=torch.bfloat16)
        exact = run_micro_batches(weight, 3)
        assert rel(gbuf.data.view(weight.shape), exact[-1]) < 2 ** -7
    finally:
        gemm_patch.apply()


# A fresh process: loads the weight saved by the test below, gives it Megatron-FSDP's attributes
# (a fresh, NaN-poisoned bucket), runs as many backwards as autograd's graph-task counter, which
# starts at 0 in every process, needs to reach the id of the backward that wrote it before it
# was saved, and then one fused backward with that id: the first write of a bucket, which must
# overwrite it.
_LOAD_AND_WRITE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
torch.cuda.current_device = lambda: "cpu"  # megatron's dummy wgrad without TE
import gemm_patch
gemm_patch.apply()
from test_fsdp_accumulate import GradBuffer, backward_micro_batches, rel
weight = torch.load(sys.argv[2], weights_only=False)
gbuf = GradBuffer(weight.numel(), torch.float32, True)
weight._gbuf, weight.get_main_grad = gbuf, lambda: gbuf.fetch_bucket().view(weight.shape)
seen = []
for _ in range(int(sys.argv[3])):
    y = torch.ones(1, requires_grad=True) * 2
    y.register_hook(lambda g: seen.append(torch._C._current_graph_task_id()))
    y.sum().backward()
assert seen == list(range(int(sys.argv[3]))), seen  # the next backward is the saved one's id
exact = next(backward_micro_batches(weight, 1))
got = gbuf.buckets[-1].view(weight.shape)
print(json.dumps({"rel": rel(got, exact), "nan": bool(torch.isnan(got).any())}))
"""


@needs_call_site
@pytest.mark.common_machinery
def test_a_saved_weight_carries_no_record_into_another_process(patched, cpu_dummy_wgrad, tmp_path):
    """A fused write's record (which backward last wrote the weight's bucket) is kept in this
    process, not in the parameter: torch.save of a weight whose hooks had not ended the record
    (here: no hooks at all), then torch.load in a new process, where graph-task ids start at 0
    again, must not make that process's first write add into its unzeroed bucket."""
    weight, _ = megatron_fsdp_param(40, 32, distributed=True)
    task = []
    x = torch.randn(48, 32).to(torch.bfloat16).requires_grad_()
    y = layers.linear_with_grad_accumulation_and_async_allreduce(
        x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False)
    y.register_hook(lambda g: task.append(torch._C._current_graph_task_id()))
    y.backward(torch.randn(y.shape).to(torch.bfloat16))
    assert weight.grad_added_to_main_grad and task and task[0] >= 0, "no fused write in a graph task"
    # What torch.save can pickle of a Megatron-FSDP parameter (its buffer and getter are not).
    weight.grad, weight.main_grad, weight.grad_added_to_main_grad = None, None, False  # zero_grad_buffer()
    del weight._gbuf, weight.get_main_grad
    torch.save(weight, tmp_path / "weight.pt")
    out = subprocess.run([sys.executable, "-c", _LOAD_AND_WRITE, str(Path(__file__).parent),
                          str(tmp_path / "weight.pt"), str(task[0])],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["nan"], "the loaded record made the first write add into the unzeroed bucket"
    assert result["rel"] < 1e-6, result
