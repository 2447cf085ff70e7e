"""Megatron only from PYTHONPATH: loaded as ``sitecustomize`` by an interpreter that has this
folder on PYTHONPATH (compat/matrix.py's children, the tests' subprocesses).

The version matrix tests a release of megatron-core or megatron-fsdp installed with
``pip --target`` in its own folder, put first on PYTHONPATH. The interpreter's own
site-packages still follow on sys.path, and whatever megatron they hold leaks in:
``importlib.metadata`` finds its ``megatron_core`` dist-info (a megatron-fsdp release then sees a
megatron-core beside it), ``import megatron`` finds it where the release has none, and
``megatron`` is a namespace package in megatron-core (no ``__init__.py``), so its portions on
every sys.path entry merge, and a regular ``megatron`` package further down wins over them all.
A test that needs megatron absent meets the same leak.

Here the path finder of ``sys.meta_path`` is swapped for one that looks up the top-level names
``megatron`` and ``megatron_fsdp``, and the distributions ``megatron-core`` and ``megatron-fsdp``,
only on sys.path entries that the interpreter did not have when it started, other than those
PYTHONPATH put there: site-packages (and what its .pth files add) hold none of them for this
process, entries added at run time (a test's ``sys.path.insert``, the script's folder) are
searched as usual. Everything else is imported as before. A ``sitecustomize`` further down
sys.path, which this one shadows, is run afterwards.

And ``torch.compile`` applied to a function compiles it at the function's first call instead of
at once. megatron decorates its fused kernels with it at import (``jit_fuser``), and the
decoration alone imports torch's dynamo and inductor: about 3 CPU-seconds of every test
process that imports megatron, for kernels few CPU tests call. A called kernel is compiled
with the same arguments as before; modules, classes and everything else go to torch.compile
as they are.

And the cyclic garbage collector is off while torch, ``megatron.core`` or ``megatron_fsdp`` runs its
package's import (everything those imports pull in with them), and back on after: an import builds
hundreds of thousands of objects and little garbage, and the collections their allocations set
off were about a fifth of every such process's import time. Nothing else runs with it off.
"""

import functools
import gc
import os
import sys

try:  # the import system's own module, loaded before site runs (importlib.machinery re-exports it)
    from _frozen_importlib_external import PathFinder
except ImportError:
    from importlib.machinery import PathFinder

_NAMES = frozenset({"megatron", "megatron_fsdp"})
_DISTRIBUTIONS = frozenset({"megatron_core", "megatron_fsdp"})  # names normalized as below
_HERE = os.path.dirname(os.path.abspath(__file__))


def _real(entry):
    try:
        return os.path.realpath(entry or os.getcwd())
    except (OSError, TypeError, ValueError):
        return entry


_FROM_PYTHONPATH = {_real(e) for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e}
_HIDDEN = frozenset(_real(e) for e in sys.path if isinstance(e, str) and _real(e) not in _FROM_PYTHONPATH)


def _visible(path):
    return [e for e in path if not (isinstance(e, str) and _real(e) in _HIDDEN)]


def _normalized(name):
    out, last = [], ""
    for char in (name or "").lower():
        char = "_" if char in "-_." else char
        if not (char == "_" and last == "_"):
            out.append(char)
        last = char
    return "".join(out)


def _compile_at_first_call(compile_now):
    @functools.wraps(compile_now)
    def compile(model=None, **options):
        if model is None:  # @torch.compile(**options)
            return lambda fn: compile(fn, **options)
        if not callable(model) or isinstance(model, type) or hasattr(model, "parameters"):
            return compile_now(model, **options)
        compiled = None

        @functools.wraps(model)
        def compiled_at_first_call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)
        return compiled_at_first_call
    return compile


_COLLECTED_AFTER = frozenset({"torch", "megatron.core", "megatron_fsdp"})  # imported with the collector off


def _without_collection(exec_module):
    @functools.wraps(exec_module)
    def exec_without_collection(module):
        was_on = gc.isenabled()  # off already inside another of these imports: left to that one
        gc.disable()
        try:
            exec_module(module)
        finally:
            if was_on:
                gc.enable()
    return exec_without_collection


def _then_compile_lazily(loader):
    exec_module = loader.exec_module

    def exec_torch(module):
        exec_module(module)
        module.compile = _compile_at_first_call(module.compile)
    loader.exec_module = exec_torch  # this spec's own loader object: no other import sees it


class MegatronFromPythonPath(PathFinder):
    """PathFinder, with megatron's names looked up only where PYTHONPATH or the running
    program put them (also when a namespace package's path is recomputed), and torch's
    ``compile`` made lazy for functions once torch is imported."""

    @classmethod
    def _get_spec(cls, fullname, path, target=None):
        if fullname in _NAMES:
            path = _visible(path)
        spec = super()._get_spec(fullname, path, target)
        if fullname in _COLLECTED_AFTER and spec is not None and hasattr(spec.loader, "exec_module"):
            if fullname == "torch":
                _then_compile_lazily(spec.loader)
            spec.loader.exec_module = _without_collection(spec.loader.exec_module)
        return spec

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        for dist in super().find_distributions(*args, **kwargs):
            name = getattr(dist, "_normalized_name", None) or _normalized(dist.metadata["Name"])
            if _normalized(name) in _DISTRIBUTIONS:
                try:
                    where = _real(str(dist.locate_file("")))
                except Exception:  # noqa: BLE001 (a distribution without a location stays)
                    where = None
                if where in _HIDDEN:
                    continue
            yield dist


sys.meta_path[:] = [MegatronFromPythonPath if finder is PathFinder else finder for finder in sys.meta_path]


def _run_the_next_sitecustomize():
    """The one Python would have run without this folder: past it on sys.path (one before it
    has run already, and runs this one: ``gemm-patch run``'s bootstrap does)."""
    entries = [e if isinstance(e, str) else "" for e in sys.path]
    here = [i for i, e in enumerate(entries) if _real(e) == _HERE]
    after = [e for e in entries[here[0] + 1 if here else 0:] if e and _real(e) != _HERE]
    spec = PathFinder.find_spec("sitecustomize", after)
    if spec is None or spec.loader is None:
        return
    module = type(sys)("sitecustomize")
    module.__file__, module.__spec__, module.__loader__ = spec.origin, spec, spec.loader
    sys.modules["sitecustomize"] = module  # `import sitecustomize` finds that one, as without this
    spec.loader.exec_module(module)


_run_the_next_sitecustomize()
