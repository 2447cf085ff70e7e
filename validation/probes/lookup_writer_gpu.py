"""The lookup writer (fsdp-embedding-wgrad) on CUDA, where autograd runs the backward on its device
thread: a weight with Megatron-FSDP's documented attributes (a persistent fp32 main_grad, a
post-accumulate hook that drops a gradient already added), against fp64; a captured gradient
(``torch.autograd.grad``), a retained graph, and the host syncs and copies of three steps.

    PYTHONPATH=. python3 validation/probes/lookup_writer_gpu.py      # on a GPU machine, torch only
"""

import types

import torch

from gemm_patch.targets import embedding_wgrad as ew
from gemm_patch.upstream import fsdp_rules as fr

dev = "cuda"
V, H, T = 4096, 256, 512
w = torch.nn.Parameter(torch.randn(V, H, device=dev).to(torch.bfloat16))
buf = torch.zeros(V, H, device=dev)
w.__fsdp_param__ = True
w._gbuf = types.SimpleNamespace(is_data_distributed=False)
w.get_main_grad = lambda: buf
w.grad_added_to_main_grad = False
seen = []
def grad_acc(p):
    seen.append(None if p.grad is None else (p.grad.data_ptr() == buf.data_ptr(), p.grad.dtype))
    if p.grad_added_to_main_grad and p.grad is not None:
        del p.grad
    p.grad_added_to_main_grad = False
grad_acc.__module__ = "megatron.fake"
w.register_post_accumulate_grad_hook(grad_acc)
fr.MANAGED.set(w, True)
fr.LOOKUP_WRITERS[ew.NAME] = True
layer = types.SimpleNamespace(config=types.SimpleNamespace(gradient_accumulation_fusion=True))
ids = torch.randint(0, V, (T,), device=dev)
g = torch.randn(T, H, device=dev).to(torch.bfloat16)
ref = torch.zeros(V, H, dtype=torch.float64, device=dev).index_add_(0, ids, g.double())
for _ in range(3):
    out = ew.fsdp_embedding(ids, w, layer=layer)
    out.backward(g)
torch.cuda.synchronize()
err = ((buf.double() - 3 * ref).norm() / (3 * ref).norm()).item()
print("main_grad rel err vs fp64 x3:", err, "hook saw:", seen[-1], "ONLY_ZEROS:", fr.ONLY_ZEROS.get(w) is not None)
# autograd.grad capture: dense gradient back, main_grad untouched
before = buf.clone()
(got,) = torch.autograd.grad(ew.fsdp_embedding(ids, w, layer=layer).float().mul(g.float()).sum(), [w])
torch.cuda.synchronize()
print("captured rel err:", ((got.double() - ref).norm() / ref.norm()).item(),
      "main_grad untouched:", torch.equal(before, buf))
# retain_graph
buf.zero_()
out = ew.fsdp_embedding(ids, w, layer=layer)
out.backward(g, retain_graph=True)
out.backward(g)
torch.cuda.synchronize()
print("retained x2 rel err:", ((buf.double() - 2 * ref).norm() / (2 * ref).norm()).item())
activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
with torch.profiler.profile(activities=activities) as prof:
    for _ in range(3):
        ew.fsdp_embedding(ids, w, layer=layer).backward(g)
    torch.cuda.synchronize()
names = [e.name for e in prof.events()]
print("syncs:", [n for n in names if n in ("aten::item", "aten::_local_scalar_dense", "aten::nonzero")],
      "copies:", sum(n in ("aten::copy_", "aten::clone", "aten::embedding_dense_backward") for n in names))
