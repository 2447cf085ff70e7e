"""Fingerprints must not depend on the Python that parses the source: the verified table is
recorded on one Python and checked on users' 3.10-3.13."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gemm_patch.engine.callsite import fingerprint

SOURCE = '''
class Layer(torch.autograd.Function):
    @staticmethod
    @custom_bwd
    def backward(ctx, grad_output, *rest, scale: float = 1.0):
        """doc"""
        if ctx.flag and x is not None:
            torch.matmul(grad_output.t(), total_input, out=weight.main_grad)
        return [a for a in rest], {"k": 1}, lambda y: y
'''
PROBE = (
    "import ast, importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('cs', sys.argv[1])\n"
    "cs = importlib.util.module_from_spec(spec); sys.modules['cs'] = cs; spec.loader.exec_module(cs)\n"
    "print(cs.fingerprint(ast.parse(sys.stdin.read()).body[0].body[0]))\n"
)


def _other_pythons() -> list[str]:
    """CPython 3.10/3.12/3.13 interpreters that actually run (pyenv shims may not)."""
    candidates = [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.1[0-3]*/bin/python"))]
    candidates += [p for v in ("3.10", "3.12", "3.13") if (p := shutil.which(f"python{v}"))]
    found: dict[str, str] = {}
    for exe in candidates:
        probe = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
        version = probe.stdout.strip()
        if probe.returncode == 0 and version != str(sys.version_info[:2]) and version not in found:
            found[version] = exe
    return list(found.values())


OTHER_PYTHONS = _other_pythons()


def test_formatting_and_comments_do_not_count_but_code_does():
    base = fingerprint(ast.parse(SOURCE).body[0].body[0])
    reformatted = SOURCE.replace("(ctx, grad_output,", "(ctx,   grad_output,  # comment\n        ")
    assert fingerprint(ast.parse(reformatted).body[0].body[0]) == base
    edited = SOURCE.replace("out=weight.main_grad", "out=weight.grad")
    assert fingerprint(ast.parse(edited).body[0].body[0]) != base


@pytest.mark.skipif(not OTHER_PYTHONS, reason="no other CPython 3.10/3.12/3.13 on PATH")
@pytest.mark.parametrize("python", OTHER_PYTHONS)
def test_same_fingerprint_on_other_python_versions(python):
    callsite = Path(__file__).resolve().parent.parent / "gemm_patch" / "engine" / "callsite.py"
    out = subprocess.run([python, "-c", PROBE, str(callsite)], input=SOURCE, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == fingerprint(ast.parse(SOURCE).body[0].body[0]), (python, sys.version)
