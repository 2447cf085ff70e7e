"""apply()/status() in fresh interpreters, most without megatron: GEMM_PATCH=0 beats everything,
every line gemm_patch prints carries its prefix, also where logging is disabled, and a bad value
read by a later apply() leaves the patch in place and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# First on PYTHONPATH: its sitecustomize hides a megatron installed in the interpreter's
# site-packages (a venv made by the README's demo has megatron-core), so none is importable.
ISOLATE = ROOT / "compat" / "isolate"


def python(code: str, **variables: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMM_PATCH") and k != "PYTHONPATH"}
    env.update(PYTHONPATH=os.pathsep.join([str(ISOLATE), str(ROOT)]), PYTHONWARNINGS="ignore", **variables)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_gemm_patch_0_beats_strict_mode_and_bad_values():
    """0.1.0 raised GemmPatchError here, although the README says GEMM_PATCH=0 beats everything."""
    out = python("import gemm_patch, sys; print('wrapt' in sys.modules, gemm_patch.status().applied)",
                 GEMM_PATCH="0", GEMM_PATCH_STRICT="1", GEMM_PATCH_BACKEND="cublas")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"] and out.stderr == ""


def test_an_explicit_apply_under_gemm_patch_0_applies_nothing_and_says_why():
    out = python("import gemm_patch; st = gemm_patch.apply(); print(st.applied); print(st.disabled); "
                 "print(st.as_dict()['disabled'] is not None)", GEMM_PATCH="0", GEMM_PATCH_BACKEND="cublas")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "False" and lines[1].startswith("GEMM_PATCH=0") and lines[2] == "True"


def test_a_bad_value_is_one_prefixed_line_even_with_logging_disabled():
    """0.1.0 printed it before its log handler existed (no prefix) and lost it under
    logging.disable."""
    for prelude in ("", "import logging; logging.disable(logging.CRITICAL); "):
        out = python(prelude + "import gemm_patch; print(gemm_patch.status().applied)", GEMM_PATCH_BACKEND="cublas")
        assert out.returncode == 0, out.stderr
        lines = out.stderr.splitlines()
        assert len(lines) == 1, out.stderr
        assert lines[0].startswith("[gemm_patch] ERROR: gemm_patch not applied: GEMM_PATCH_BACKEND='cublas'")
        assert out.stdout.strip() == "False"


def test_a_bad_value_under_strict_mode_raises():
    out = python("import gemm_patch", GEMM_PATCH_STRICT="1", GEMM_PATCH_APEX="maybe")
    assert out.returncode == 1 and "GemmPatchError" in out.stderr and "GEMM_PATCH_APEX='maybe'" in out.stderr


def test_status_without_megatron_reads_not_applicable_with_reasons():
    out = python("import gemm_patch, json; print(json.dumps([t.state for t in gemm_patch.status().targets]))")
    assert out.returncode == 0, out.stderr
    assert set(eval(out.stdout)) == {"not applicable"}


BAD_VALUE_AFTER_APPLY = """
import os, json, megatron.core.tensor_parallel.layers as L, gemm_patch
os.environ["GEMM_PATCH_BACKEND"] = "fallbak"
st = gemm_patch.apply()
backward = vars(L.LinearWithGradAccumulationAndAsyncCommunication)["backward"]
print("REPORT", json.dumps({"applied": st.applied, "fsdp-wgrad": [t.state for t in st.targets
                            if t.name == "fsdp-wgrad"][0], "text": st.render(),
                            "patched": getattr(backward, "_self_gemm_patch_target", None) is not None}))
"""


def test_a_bad_value_read_by_apply_in_a_patched_process_says_the_earlier_patch_stays():
    """0.4.0 logged "gemm_patch not applied" and its status said the bad value "leaves gemm_patch
    unapplied", beside applied/verified, while every patch kept running."""
    from process_env import clean_env

    out = subprocess.run([sys.executable, "-c", BAD_VALUE_AFTER_APPLY], capture_output=True, text=True,
                         env=clean_env(megatron=True), timeout=300)
    line = next((line for line in out.stdout.splitlines() if line.startswith("REPORT ")), None)
    assert out.returncode == 0 and line, out.stderr[-3000:]
    found = json.loads(line[len("REPORT "):])
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "GEMM_PATCH_BACKEND='fallbak'" in errors[0], out.stderr
    assert "not applied" not in errors[0] and "earlier stays in force" in errors[0], errors[0]
    assert found["applied"] and found["patched"] and found["fsdp-wgrad"] == "verified", found
    assert "unapplied" not in found["text"] and "earlier stays in force" in found["text"], found["text"]
    assert "backends: none configured" not in found["text"], found["text"]
