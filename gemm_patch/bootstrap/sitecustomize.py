"""The sitecustomize of every Python process started under ``gemm-patch run``.

``gemm-patch run`` puts this directory first on PYTHONPATH, so Python's ``site`` imports this
file instead of the sitecustomize it would otherwise have run (the user's own, or one that a
distribution or container image ships). This file therefore

1. finds that other sitecustomize (the next one on sys.path after this directory) and runs it,
   first, so the process is set up exactly as it would have been without the launcher;
2. then starts gemm_patch's start-up hook, ``_gemm_patch_startup`` (its neighbour in the source
   tree; a wheel install ships that module at the root of site-packages instead), which imports
   gemm_patch (so applies it) when the process first imports megatron, megatron_fsdp, ...; a
   process that never does never imports gemm_patch. If that sitecustomize already imported
   megatron, gemm_patch is imported at once.

It never raises: a failure of its own is one line on stderr, and the process runs on
unpatched. The syntax stays plain because any interpreter started under the launcher parses
this file, whatever its version.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _same_dir(entry, directory):
    try:
        return os.path.normcase(os.path.abspath(entry or os.curdir)) == os.path.normcase(directory)
    except Exception:
        return False


def _entries_after_here():
    """sys.path past this directory: where Python would have looked for sitecustomize next.
    (Entries before it cannot hold one, or Python would have imported that instead.)"""
    for index, entry in enumerate(sys.path):
        if _same_dir(entry, _HERE):
            return [e for e in sys.path[index + 1:] if not _same_dir(e, _HERE)]
    return [e for e in sys.path if not _same_dir(e, _HERE)]


def _import_machinery():
    """(PathFinder, module_from_spec): the objects importlib.machinery and importlib.util
    re-export, taken from the import system's own modules, which every CPython has loaded before
    site runs; importing importlib.util instead costs a few milliseconds (contextlib,
    collections, functools) in every process."""
    try:
        import _frozen_importlib
        import _frozen_importlib_external

        return _frozen_importlib_external.PathFinder, _frozen_importlib.module_from_spec
    except (ImportError, AttributeError):
        import importlib.machinery
        import importlib.util

        return importlib.machinery.PathFinder, importlib.util.module_from_spec


def _run_next_sitecustomize():
    path_finder, module_from_spec = _import_machinery()
    spec = path_finder.find_spec("sitecustomize", _entries_after_here())
    if spec is None or spec.loader is None:
        return
    ours = sys.modules.get("sitecustomize")
    module = module_from_spec(spec)
    # Installed under the name it was written for, so that `import sitecustomize` later on
    # finds the user's module, as it would have without the launcher.
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        # Exactly what site.py would have done had it imported that file itself.
        if ours is not None:
            sys.modules["sitecustomize"] = ours
        if sys.flags.verbose:
            sys.excepthook(*sys.exc_info())
        else:
            sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                             "%s: %s\n" % (err.__class__.__name__, err))


def _report(what, exc):
    try:
        sys.stderr.write("[gemm_patch] ERROR: %s (%s: %s) [start-up hook: gemm-patch run]\n"
                         % (what, type(exc).__name__, exc))
    except Exception:
        pass


# Set on sys while _main runs. A sitecustomize that, like this one, runs "the next one on
# sys.path" but skips only its own folder finds this file again and runs it: without the mark
# the two would run each other until a RecursionError.
_RUNNING = "_gemm_patch_bootstrap_running"


def _main():
    if getattr(sys, _RUNNING, False):
        return  # run again from the sitecustomize that the outer run is running: nothing to do
    setattr(sys, _RUNNING, True)
    try:
        _run_next_sitecustomize()
    except Exception as exc:
        _report("could not look for the sitecustomize this one stands in for", exc)
    finally:
        try:
            delattr(sys, _RUNNING)
        except AttributeError:
            pass
    try:
        import _gemm_patch_startup
    except Exception as exc:
        _report("cannot import the start-up hook; this process runs unpatched", exc)
        return
    _gemm_patch_startup.start("gemm-patch run")


_main()
