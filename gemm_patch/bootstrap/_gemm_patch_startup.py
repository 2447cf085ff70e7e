"""The start-up hook shared by ``gemm-patch run`` (through its sitecustomize) and the
``GEMM_PATCH_AUTO`` switch (through ``gemm_patch_auto.pth``): patch this interpreter if, and
only when, it imports a package that gemm_patch patches, and never break it.

Lazy: ``start()`` imports nothing. It puts a small finder first on ``sys.meta_path`` that
waits for the first module under one of ``TRIGGERS`` (the top-level packages of the
patched modules). Before that module's code runs, the finder imports gemm_patch, which
applies and registers its own post-import hooks for the modules it patches, then takes itself
off ``sys.meta_path`` and lets the module load as it would have. A process that never imports
megatron never imports gemm_patch (nor wrapt).

Why the import happens in the loader and not in ``find_spec``: Python calls ``find_spec``
holding its global import lock, and importing a package there deadlocks against another
thread that is importing one of that package's dependencies (it holds that module's lock and
waits for the global one). The finder therefore only wraps the loader of the first such module
(and restores the original loader before anything else sees the wrapper); ``exec_module`` runs
without the global lock. A namespace package (megatron-core's ``megatron``) has no code of its
own: the first of its submodules that has code (``megatron.core``) is the one that waits.

Why a top-level module and not ``gemm_patch._auto``: this hook has to catch a failing
``import gemm_patch`` itself (a missing wrapt, or the GemmPatchError that the package's
import raises in strict mode), and no module inside the package can run before the package's
own ``__init__``. The wheel ships it at its root next to the .pth file (the same pattern as
setuptools' ``distutils-precedence.pth`` and ``_distutils_hack``); the launcher's bootstrap
directory holds the same file, so it is importable wherever the bootstrap is.

Standard library only, and only modules every interpreter has loaded before site runs (os,
sys, _thread); nothing at all is done when ``GEMM_PATCH=0``. A failure is one line on stderr
and an unpatched, running process; with ``GEMM_PATCH_STRICT=1`` it is that line and exit
status 1 instead, and so is gemm_patch refusing a target module's code later, when that module
is imported, in whichever thread (``_StrictGuard``). The syntax stays plain because any
interpreter started under the launcher parses this file, whatever its version.
"""

import os
import sys

try:
    import _thread
except ImportError:  # Python 2, started under the launcher: parse and fail in one line
    import thread as _thread

# The top-level packages of the modules gemm_patch patches (gemm_patch.targets.REGISTRY;
# tests/test_auto_pth.py checks that the two agree). Importing anything under one of these
# imports gemm_patch; nothing else does.
TRIGGERS = ("megatron", "megatron_fsdp", "nemo", "transformer_engine")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

# Both hooks can fire in one process (the launcher also sets GEMM_PATCH_AUTO=1, so an
# environment with the .pth runs it first, and it defers to the launcher's sitecustomize where
# that comes next); a second call must neither redo nor re-report.
_finder = None
_done = False  # gemm_patch's import was attempted (whatever came of it)
_lock = _thread.allocate_lock()  # held for a few assignments, never across an import


def _flag(name):
    return os.environ.get(name, "").strip().lower()


def _off():
    """GEMM_PATCH=0, unless the read-only gradient probe is asked for (GEMM_PATCH_GRAD_PROBE, set
    by `gemm-patch compare` in its fusion-off run): gemm_patch is then imported, applies nothing,
    and installs the probe."""
    return _flag("GEMM_PATCH") in _FALSE and not os.environ.get("GEMM_PATCH_GRAD_PROBE")


def start(source):
    """Arrange for gemm_patch to be imported (so applied) in this process when a target's
    package is imported; ``source`` names the hook in messages."""
    global _finder
    if _done or _off():
        return  # GEMM_PATCH=0 beats every entry point; don't even import the package
    if _finder is not None:
        return
    if source == "GEMM_PATCH_AUTO" and _launcher_sitecustomize_comes_next():
        return
    if sys.version_info < (3, 5) or any(name in sys.modules for name in TRIGGERS):
        # A target's package is already here (a sitecustomize imported it), or an interpreter
        # too old for loaders with exec_module: no reason to wait.
        load_gemm_patch(source)
        return
    _finder = _Finder(source)
    sys.meta_path.insert(0, _finder)


def _launcher_sitecustomize_comes_next():
    """True when site will import the launcher's bootstrap sitecustomize after the .pth files.
    That one runs the sitecustomize that would have run without the launcher first and then
    starts this hook, so the .pth hook (which fires earlier, while site-packages are processed)
    leaves it the work: nothing of gemm_patch's, not even the finder, is there while that other
    sitecustomize runs, and a megatron it imports is patched right after it."""
    if "sitecustomize" in sys.modules:
        return False
    try:
        try:  # the import system's own PathFinder: loaded already, unlike importlib.machinery
            from _frozen_importlib_external import PathFinder
        except ImportError:
            from importlib.machinery import PathFinder
        spec = PathFinder.find_spec("sitecustomize")
        origin = os.path.dirname(os.path.abspath(spec.origin)) if spec and spec.origin else ""
    except Exception:
        return False
    return origin.endswith(os.path.join("gemm_patch", "bootstrap"))


def load_gemm_patch(source, trigger=None):
    """Import gemm_patch for this process (it applies itself on import and reports a bad
    variable once on its own); a failure is one line, or exit 1 in strict mode.

    Threads: the first caller imports it; one that comes while that import runs imports it too,
    which waits for the first through Python's own module lock (with its deadlock detection),
    so its module, too, runs only once gemm_patch is there. Only the first caller reports."""
    global _done, _finder
    with _lock:
        first, _done = not _done, True
        finder, _finder = _finder, None
    if finder is not None:
        try:
            sys.meta_path.remove(finder)
        except ValueError:
            pass
    if _off():
        return  # set since start-up (by a sitecustomize, say): still nothing imported
    try:
        import gemm_patch  # noqa: F401
    except Exception as exc:
        if first:
            _fail(source, exc, trigger)
        return
    if first and _flag("GEMM_PATCH_STRICT") in _TRUE:
        _guard_strict_refusals(source)


class _TriggerFinder(object):
    """On sys.meta_path: for a module under TRIGGERS, hands back the spec that the finders behind
    it find, with its loader wrapped (``wrap``). Two kinds: the start-up finder (first until
    gemm_patch is loaded: the first trigger's loader loads gemm_patch before the module runs) and,
    in strict mode, the guard (first for good: a refusal while a trigger runs ends the process)."""

    def __init__(self, source):
        self.source = source
        self._busy = set()  # threads inside find_spec (the finders asked below may ask again)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in TRIGGERS or not self.active():
            return None
        me = _thread.get_ident()
        if me in self._busy:
            return None
        self._busy.add(me)
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self:
                    continue
                find = getattr(finder, "find_spec", None)
                if find is None:
                    if hasattr(finder, "find_module"):
                        return None  # a legacy finder: leave this import to Python's own loop
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        except Exception:
            return None  # Python's own loop asks the same finders and reports what they raise
        finally:
            self._busy.discard(me)
        if spec is None:
            return None
        loader = spec.loader
        if loader is None or "NamespaceLoader" in type(loader).__name__:
            return spec  # no code to run: wait for a submodule that has some
        return self.wrap(spec, loader)

    def active(self):
        return True

    def wrap(self, spec, loader):
        raise NotImplementedError


class _Finder(_TriggerFinder):
    """The start-up finder: wraps the loader of the first module under TRIGGERS."""

    def active(self):
        return not _done

    def wrap(self, spec, loader):
        if not hasattr(loader, "exec_module"):
            # A legacy loader (load_module only): load gemm_patch now, here.
            load_gemm_patch(self.source, spec.name)
            return spec
        spec.loader = _WrappedLoader(loader, self.source, _load_then_run)
        return spec


class _StrictGuard(_TriggerFinder):
    """Strict mode only, once gemm_patch is loaded, first on sys.meta_path for good: wraps the
    loader of every module under TRIGGERS so that a GemmPatchError raised while one executes
    (gemm_patch refusing code it does not know, from its post-import hook) ends the process
    with one line and exit status 1, as a refusal while gemm_patch itself is imported does.
    Left to propagate, it would be a traceback through the user's imports and, raised in a
    thread, would end only that thread while the rest of the process ran on unpatched.

    It must come before gemm_patch's own post-import finder on sys.meta_path, so that the
    loader that finder wraps (the one whose hook raises) runs inside this one's ``exec_module``:
    ``_guard_strict_refusals`` inserts it after ``import gemm_patch`` has put that finder there."""

    def wrap(self, spec, loader):
        if hasattr(loader, "exec_module"):
            spec.loader = _WrappedLoader(loader, self.source, _run_guarded)
        return spec


class _WrappedLoader(object):
    """A trigger's loader for the instant between finding its module and running it: puts the
    real loader back, then runs the module through ``run(loader, source, module)``."""

    def __init__(self, loader, source, run):
        self.loader = loader
        self.source = source
        self.run = run

    def __getattr__(self, name):  # anything else a loader offers (get_code, is_package, ...)
        if name in ("loader", "source", "run"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec):
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        self.run(self.loader, self.source, module)


def _load_then_run(loader, source, module):
    load_gemm_patch(source, module.__name__)
    loader.exec_module(module)


def _is_refusal(exc):
    """A GemmPatchError (compared by name: this module never imports gemm_patch itself)."""
    return type(exc).__name__ == "GemmPatchError" and type(exc).__module__.startswith("gemm_patch")


def _run_guarded(loader, source, module):
    try:
        loader.exec_module(module)
    except Exception as exc:
        # The innermost guarded module stops the process; an outer one sees it only when
        # gemm_patch raised it with GEMM_PATCH_STRICT since unset (apply(strict=True)).
        if _is_refusal(exc) and _flag("GEMM_PATCH_STRICT") in _TRUE:
            _fail(source, exc, module.__name__)
        raise


def _guard_strict_refusals(source):
    with _lock:
        if any(isinstance(finder, _StrictGuard) for finder in sys.meta_path):
            return
        sys.meta_path.insert(0, _StrictGuard(source))


def _fail(source, exc, trigger=None):
    strict = _flag("GEMM_PATCH_STRICT") in _TRUE
    if type(exc).__name__ == "GemmPatchError":
        reason = str(exc)
        if reason.startswith("gemm_patch: "):
            reason = reason[len("gemm_patch: "):]
    else:
        reason = "cannot import gemm_patch in %s (%s: %s)" % (sys.executable, type(exc).__name__, exc)
    hook = source if trigger is None else "%s, on import of %s" % (source, trigger)
    outcome = "stopping (GEMM_PATCH_STRICT=1)" if strict else "this process runs unpatched"
    try:
        sys.stderr.write("[gemm_patch] ERROR: %s [start-up hook: %s]; %s\n" % (reason, hook, outcome))
        sys.stderr.flush()
    except Exception:
        pass  # no usable stderr: staying silent beats breaking the interpreter
    if strict:
        # SystemExit raised during site initialisation is a "Fatal Python error" with a
        # traceback, and in a thread it only ends that thread; an immediate exit keeps it to
        # the one line above and stops the process wherever the import happens. What the
        # process printed before is flushed first.
        try:
            sys.stdout.flush()
        except Exception:
            pass
        os._exit(1)
