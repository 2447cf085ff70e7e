"""te-dummy-wgrad with the real Transformer Engine on a GPU: a TE ``Linear`` with
``fuse_wgrad_accumulation`` returns a dummy that is not TE's cached tensor, its main_grad still
sums every backward, the cached tensor comes back during CUDA-graph capture, and after
``revert()`` TE's cache is used again (so the first test can fail)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
te = pytest.importorskip("transformer_engine.pytorch")

import gemm_patch  # noqa: E402


def storage(t) -> int:
    return t.untyped_storage().data_ptr()


def run_backwards(layer, n: int = 3):
    weight = layer.weight
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device="cuda")
    weight.grad_added_to_main_grad = False
    seen: list[int] = []

    def hook(param):  # what Megatron-FSDP's _grad_acc does with a fused weight
        seen.append(storage(param.grad))
        param.grad = None

    handle = weight.register_post_accumulate_grad_hook(hook)
    total = torch.zeros(weight.shape, dtype=torch.float64, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    try:
        for _ in range(n):
            x = torch.randn(128, layer.in_features, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
            y = layer(x)
            g = torch.randn(y.shape, device="cuda", generator=gen).to(torch.bfloat16)
            y.backward(g)
            total += g.double().t() @ x.detach().double()
            weight.grad_added_to_main_grad = False
    finally:
        handle.remove()
    rel = ((weight.main_grad.double() - total).norm() / total.norm()).item()
    return seen, rel


def cached_storages() -> set[int]:
    from transformer_engine.pytorch.module import base

    return {storage(t) for t in base._dummy_wgrads.values()}


@pytest.fixture
def layer():
    return te.Linear(256, 512, bias=False, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True).cuda()


def test_te_linear_dummy_is_per_call_and_main_grad_sums(layer):
    status = {t.name: t for t in gemm_patch.apply().targets}["te-dummy-wgrad"]
    assert status.state in ("verified", "compatible"), status.reason
    seen, rel = run_backwards(layer)
    assert len(seen) == 3 and not set(seen) & cached_storages()
    assert rel < 1e-3


def test_after_revert_te_uses_its_cache_again(layer):
    gemm_patch.revert()
    try:
        seen, rel = run_backwards(layer)
        assert set(seen) <= cached_storages() and len(set(seen)) == 1
        assert rel < 1e-3
    finally:
        gemm_patch.apply()


def test_cuda_graph_capture_gets_the_cached_tensor():
    gemm_patch.apply()
    from transformer_engine.pytorch.module import base, linear

    assert linear.get_dummy_wgrad is not base.get_dummy_wgrad
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out = linear.get_dummy_wgrad([16, 8], torch.bfloat16)
    assert storage(out) == storage(base._dummy_wgrads[(16, 8, torch.bfloat16)])
