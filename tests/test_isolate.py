"""compat/isolate, the sitecustomize of every test and matrix process: torch.compile on a function
compiles at the first call, with the options it was given, and gives the compiled result."""

from __future__ import annotations

import json
import subprocess
import sys

from process_env import ISOLATE, ROOT

CODE = r"""
import json, sys, torch
def double_plus_one(x):
    return x * 2 + 1
lazy = torch.compile(double_plus_one, backend="eager")
decorated = torch.compile(backend="eager")(double_plus_one)
before = "torch._dynamo" in sys.modules
module = torch.compile(torch.nn.Linear(2, 2), backend="eager")
out = lazy(torch.ones(3)).tolist()
print(json.dumps({"dynamo_before_first_call": before, "out": out, "name": lazy.__name__,
                  "wrapped": lazy.__wrapped__ is double_plus_one, "decorated": decorated(torch.zeros(1)).tolist(),
                  "module": type(module).__name__, "dynamo_after": "torch._dynamo" in sys.modules}))
"""


def test_torch_compile_of_a_function_compiles_at_its_first_call():
    env = {"PYTHONPATH": f"{ISOLATE}:{ROOT}", "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["dynamo_before_first_call"] is False  # the decoration alone imports nothing of dynamo
    assert got["out"] == [3.0, 3.0, 3.0] and got["decorated"] == [1.0]
    assert got["name"] == "double_plus_one" and got["wrapped"]
    assert got["module"] == "OptimizedModule" and got["dynamo_after"]  # a module is compiled at once, as before
