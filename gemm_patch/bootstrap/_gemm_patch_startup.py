"""The start-up hook shared by ``gemm-patch run`` (through its sitecustomize) and the
``GEMM_PATCH_AUTO`` switch (through ``gemm_patch_auto.pth``): apply gemm_patch in this
interpreter, and never break it.

Why a top-level module and not ``gemm_patch._auto``: this hook has to catch a failing
``import gemm_patch`` itself (a missing wrapt, or the GemmPatchError that the package's
import raises in strict mode), and no module inside the package can run before the package's
own ``__init__``. The wheel ships it at its root next to the .pth file (the same pattern as
setuptools' ``distutils-precedence.pth`` and ``_distutils_hack``); the launcher's bootstrap
directory holds the same file, so it is importable wherever the bootstrap is.

Standard library only, and nothing at all is imported when ``GEMM_PATCH=0``. A failure is one
line on stderr and an unpatched, running process; with ``GEMM_PATCH_STRICT=1`` it is that line
and exit status 1 instead. The syntax stays plain because any interpreter started under the
launcher parses this file, whatever its version.
"""

import os
import sys

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

# Both hooks can fire in one process (the launcher also sets GEMM_PATCH_AUTO=1, so an
# environment with the .pth runs it first); the second call must neither redo nor re-report.
_started = False


def _flag(name):
    return os.environ.get(name, "").strip().lower()


def start(source):
    """Apply gemm_patch once for this process; ``source`` names the hook in messages."""
    global _started
    if _started or _flag("GEMM_PATCH") in _FALSE:
        return  # GEMM_PATCH=0 beats every entry point; don't even import the package
    if source == "GEMM_PATCH_AUTO" and _launcher_sitecustomize_comes_next():
        return
    _started = True
    try:
        # The package applies itself on import and reports a bad variable once on its own
        # (leaving the process unpatched); it raises only in strict mode or when broken.
        import gemm_patch  # noqa: F401
    except Exception as exc:
        _fail(source, exc)


def _launcher_sitecustomize_comes_next():
    """True when site will import the launcher's bootstrap sitecustomize after the .pth files.
    It runs the user's own sitecustomize first and then applies the patch, so the .pth hook
    (which fires earlier, while site-packages are processed) defers to it."""
    if "sitecustomize" in sys.modules:
        return False
    try:
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec("sitecustomize")
        origin = os.path.dirname(os.path.abspath(spec.origin)) if spec and spec.origin else ""
    except Exception:
        return False
    return origin.endswith(os.path.join("gemm_patch", "bootstrap"))


def _fail(source, exc):
    strict = _flag("GEMM_PATCH_STRICT") in _TRUE
    if type(exc).__name__ == "GemmPatchError":
        reason = str(exc)
        if reason.startswith("gemm_patch: "):
            reason = reason[len("gemm_patch: "):]
    else:
        reason = "cannot import gemm_patch in %s (%s: %s)" % (sys.executable, type(exc).__name__, exc)
    outcome = "stopping (GEMM_PATCH_STRICT=1)" if strict else "this process runs unpatched"
    try:
        sys.stderr.write("[gemm_patch] ERROR: %s [start-up hook: %s]; %s\n" % (reason, source, outcome))
        sys.stderr.flush()
    except Exception:
        pass  # no usable stderr: staying silent beats breaking the interpreter
    if strict:
        # SystemExit raised during site initialisation is a "Fatal Python error" with a
        # traceback; an immediate exit keeps it to the one line above.
        os._exit(1)
