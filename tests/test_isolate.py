"""compat/isolate, the sitecustomize of every test and matrix process: torch.compile on a function
compiles at the first call, with the options it was given, and gives the compiled result; the
garbage collector is off during the imports of torch, megatron.core and megatron_fsdp only."""

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


# A stand-in megatron_fsdp (a top-level name isolate wraps) that reports the collector's state
# while it is imported, and imports a module of its own that is not wrapped.
PACKAGE = "import gc, json, os\nSTATE = gc.isenabled()\n"
GC_CODE = r"""
import gc, json, sys
if sys.argv[1] == "off":
    gc.disable()
import megatron_fsdp
during = megatron_fsdp.STATE
import plain_module
print(json.dumps({"during": during, "after": gc.isenabled(), "plain": plain_module.STATE}))
"""


def test_the_collector_is_off_only_while_a_wrapped_package_is_imported(tmp_path):
    (tmp_path / "megatron_fsdp").mkdir()
    (tmp_path / "megatron_fsdp" / "__init__.py").write_text(PACKAGE)
    (tmp_path / "plain_module.py").write_text(PACKAGE)
    env = {"PYTHONPATH": f"{ISOLATE}:{tmp_path}", "PATH": "/usr/bin:/bin"}
    found = {}
    for before in ("on", "off"):
        proc = subprocess.run([sys.executable, "-c", GC_CODE, before], capture_output=True, text=True, env=env,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[before] = json.loads(proc.stdout)
    assert found["on"] == {"during": False, "after": True, "plain": True}
    assert found["off"] == {"during": False, "after": False, "plain": False}  # the program's own choice stays
