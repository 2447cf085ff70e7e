"""The target contract (tests/contract.py) for the two targets whose package cannot be imported
on a CPU machine: te-dummy-wgrad (Transformer Engine needs its CUDA library) and nemo-fsdp-gaf
(NeMo needs its dependency chain), on every release of their fingerprint tables.

Each release's module is built from that release's own files (tests/te_files.py,
``compat/te_sources.py``; tests/test_nemo_target.py's ``nemo_module``, ``compat/nemo_sources.py``)
and put into ``sys.modules`` under its real name, with the release's version where gemm_patch
reads it (TE's ``transformer_engine.__version__``; nemo-toolkit's metadata, stood in for), so
that ``gemm_patch.apply()`` judges it as it would the installed package: ``verified``. Then the
contract's own checks run unchanged: apply / revert / apply by identity, an object replaced by
someone else, unknown code (default and strict), GEMM_PATCH_DISABLE, and, with no such package
at all, not applicable.

Left out, because a module built from source has no loader to run it again: the import-order
check (a fresh interpreter importing the package), ``importlib.reload`` and the fresh import
after ``del sys.modules[...]``. A release whose files are not fetched is skipped.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.util
import sys
from collections.abc import Iterator

import contract
import pytest
from te_files import install_te_modules, te_root

import gemm_patch
from gemm_patch.engine import detection
from gemm_patch.engine.target import NOT_APPLICABLE, VERIFIED
from gemm_patch.targets import nemo_fsdp_gaf, te_dummy_wgrad

pytest.importorskip("torch")  # TE's base module is compiled against torch (tests/te_files.py)

TE, NEMO = te_dummy_wgrad.TARGET, nemo_fsdp_gaf.TARGET
_ABSENT = object()


def releases(target) -> list[str]:
    return sorted(target.fingerprints, key=lambda v: tuple(int(x) for x in v.split(".")))


@contextlib.contextmanager
def modules_in_place(build) -> Iterator[None]:
    """``build(setitem)`` puts modules into sys.modules; on exit gemm_patch is reverted while
    they are there, they are taken out again, and gemm_patch applied as before."""
    saved: dict[str, object] = {}

    def setitem(mapping, name, value):
        saved.setdefault(name, mapping.get(name, _ABSENT))
        mapping[name] = value

    try:
        build(setitem)
        yield
    finally:
        gemm_patch.revert()
        for name, value in saved.items():
            if value is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = value
            contract.forget(name, keep=value)  # the release's modules: gone, not patched again
        gemm_patch.apply()


@contextlib.contextmanager
def te_release(version: str, monkeypatch) -> Iterator[tuple]:
    if not te_root(version).exists():
        pytest.skip(f"TE {version}'s files not fetched: run python compat/te_sources.py")

    def build(setitem):
        install_te_modules(version, setitem)
        sys.modules["transformer_engine"].__version__ = version  # where gemm_patch reads TE's version

    with modules_in_place(build):
        yield TE, VERIFIED


@contextlib.contextmanager
def nemo_release(version: str, monkeypatch) -> Iterator[tuple]:
    from test_nemo_target import MODULE, nemo_module, source_file

    path = source_file(version)  # skips where the release is not fetched
    reads = detection.distribution_version
    monkeypatch.setattr(detection, "distribution_version",
                        lambda component: version if component == NEMO.distribution else reads(component))
    monkeypatch.setenv(NEMO.switch_variable, "1")  # an opt-in target
    module = nemo_module(path)
    module.__builtins__ = builtins.__dict__  # as executing the file sets it
    with modules_in_place(lambda setitem: setitem(sys.modules, MODULE, module)):
        yield NEMO, VERIFIED


# Module-scoped, so that pytest runs each release's checks one after the other: gemm_patch parses
# a release's files once for all of them (its cache of parsed sources holds a few releases).
both = pytest.mark.parametrize("release", [
    *[pytest.param((te_release, v), id=f"{TE.name}-{v}") for v in releases(TE)],
    *[pytest.param((nemo_release, v), id=f"{NEMO.name}-{v}") for v in releases(NEMO)],
], indirect=True, scope="module")


@pytest.fixture(scope="module")
def release(request):
    return request.param


@pytest.fixture
def loaded(release, monkeypatch):
    """(target, expected state), with the release's module in sys.modules."""
    build, version = release
    with build(version, monkeypatch) as found:
        yield found


@both
def test_apply_revert_apply(loaded):
    contract.check_apply_revert_apply(*loaded)


@both
def test_replaced_object_is_left_alone(loaded):
    contract.check_replaced(*loaded)


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@both
def test_unknown_code_is_left_alone(loaded, strict):
    contract.check_unknown_code(*loaded, strict)


@both
def test_disable_leaves_it_off(loaded):
    contract.check_disable(*loaded)


@pytest.mark.parametrize("target", [TE, NEMO], ids=lambda t: t.name)
def test_no_such_package_is_not_applicable_and_changes_nothing(target, monkeypatch):
    top = target.module.split(".")[0]
    if importlib.util.find_spec(top) is not None:
        pytest.skip(f"{top} is installed here")
    if target is NEMO:
        monkeypatch.setenv(NEMO.switch_variable, "1")
    contract.check_not_applicable(target, NOT_APPLICABLE)
