"""te-dummy-wgrad against Transformer Engine's own files, every release it records.

TE's ``get_dummy_wgrad`` (compiled from each release's ``base.py``, tests/te_files.py) caches one
tensor per shape for the whole process; after the patch, TE's ``Linear`` and ``LayerNormLinear``
modules reach a function that allocates per call. Each test can fail: the caching function
returns the same storage every call, the patched one never does.
"""

from __future__ import annotations

import dataclasses

import pytest
from te_files import install_te_modules, te_root

torch = pytest.importorskip("torch")

from gemm_patch.engine import config  # noqa: E402
from gemm_patch.engine.target import Refused  # noqa: E402
from gemm_patch.targets import te_dummy_wgrad  # noqa: E402

TARGET = te_dummy_wgrad.TARGET
RELEASES = list(TARGET.fingerprints)


def cfg(**env: str):
    return config.load(env, switches={TARGET.switch_variable: True})


@pytest.fixture
def te(monkeypatch, request):
    version = request.param
    if not te_root(version).exists():
        pytest.skip(f"TE {version}'s files not fetched: run python compat/te_sources.py")
    monkeypatch.setattr(te_dummy_wgrad, "DEVICE", "cpu")
    modules = install_te_modules(version, monkeypatch.setitem)
    return version, modules


def storage(t) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("te", RELEASES, indirect=True)
def test_upstream_caches_and_the_patch_allocates_per_call(te):
    version, m = te
    cached = m["base"].get_dummy_wgrad
    assert storage(cached([64, 32], torch.bfloat16)) == storage(cached([64, 32], torch.bfloat16))

    status, undo = TARGET.patch(m["package"], version, cfg())
    assert status.state == "verified", status.reason
    for short in ("linear", "layernorm_linear"):
        patched = m[short].get_dummy_wgrad
        assert patched is not cached and patched.__wrapped__ is cached
        a, b = patched([64, 32], torch.bfloat16), patched([64, 32], torch.bfloat16)
        assert a.shape == (64, 32) and a.dtype == torch.bfloat16 and storage(a) != storage(b)
        zero = patched([8, 4], torch.float32, zero=True)
        assert torch.count_nonzero(zero) == 0 and zero.dtype == torch.float32
    assert m["base"].get_dummy_wgrad is cached, "TE's own function (GroupedLinear, op fuser) stays"
    assert list(m["base"]._dummy_wgrads) == [(64, 32, torch.bfloat16)], "the patch never fills the cache"
    assert undo.run() == []
    assert m["linear"].get_dummy_wgrad is cached and m["layernorm_linear"].get_dummy_wgrad is cached


@pytest.mark.parametrize("te", ["2.20.2"], indirect=True)
def test_cuda_graph_capture_gets_the_cached_tensor(te, monkeypatch):
    version, m = te
    TARGET.patch(m["package"], version, cfg())
    monkeypatch.setattr(te_dummy_wgrad, "DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    patched = m["linear"].get_dummy_wgrad
    assert storage(patched([16, 8], torch.bfloat16)) == storage(m["base"]._dummy_wgrads[(16, 8, torch.bfloat16)])


@pytest.mark.parametrize("te", ["2.20.2"], indirect=True)
@pytest.mark.parametrize("mode", ["default", "strict", "allow"])
def test_unknown_code_is_left_alone_unless_allowed_and_refused_in_strict_mode(te, mode):
    version, m = te
    unknown = dataclasses.replace(TARGET, fingerprints={})
    cached = m["base"].get_dummy_wgrad
    env = {"default": {}, "strict": {"GEMM_PATCH_STRICT": "1"}, "allow": {"GEMM_PATCH_ALLOW_UNVERIFIED": "1"}}[mode]
    if mode == "strict":
        with pytest.raises(Refused):
            unknown.patch(m["package"], version, cfg(**env))
        assert m["linear"].get_dummy_wgrad is cached
        return
    status, _ = unknown.patch(m["package"], version, cfg(**env))
    assert status.state == {"default": "unverified", "allow": "forced"}[mode], status.reason
    assert (m["linear"].get_dummy_wgrad is cached) == (mode == "default")


@pytest.mark.parametrize("te", ["2.20.2"], indirect=True)
def test_a_function_replaced_by_someone_else_is_left_alone(te):
    version, m = te
    foreign = lambda shape, dtype, zero=False: None  # noqa: E731
    m["layernorm_linear"].get_dummy_wgrad = foreign
    status, _ = TARGET.patch(m["package"], version, cfg())
    assert status.state == "skipped" and "replaced" in status.reason, status.reason
    assert m["layernorm_linear"].get_dummy_wgrad is foreign
    assert m["linear"].get_dummy_wgrad is m["base"].get_dummy_wgrad


@pytest.mark.parametrize("te", ["2.20.2"], indirect=True)
def test_switched_off(te):
    version, m = te
    status, _ = TARGET.patch(m["package"], version, cfg(GEMM_PATCH_TE_DUMMY_WGRAD="0"))
    assert status.state == "off" and m["linear"].get_dummy_wgrad is m["base"].get_dummy_wgrad
