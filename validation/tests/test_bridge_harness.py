"""validation/frameworks/bridge/run_bridge.py on the CPU (no GPU, no Bridge): every torchrun is
handed a .py training script, never an interpreter (all four pretraining runs die on that), and the
checker refuses the broken form; a rank killed while writing its result stops no
stage of the driver, and merge_results.py rebuilds a stopped driver's record from its logs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from validation.frameworks.bridge import run_bridge as rb

ROOT = Path(__file__).resolve().parents[2]
BRIDGE = ROOT / "validation" / "frameworks" / "bridge"


def args(*extra: str):
    class A:
        iters, test_path = 12, "tests/functional_tests/test_groups/megatron_fsdp"
    for k, v in zip(extra[::2], extra[1::2], strict=True):
        setattr(A, k, v)
    return A


def test_every_job_command_passes_the_check():
    jobs = rb.build_jobs(args(), {}, rb.WORK / "bt", set())
    assert [j.name for j in jobs] == ["unpatched", "patched", "off", "off_repeat", "tests_unpatched", "tests_patched"]
    assert rb.check_commands([*jobs, rb.timing_job(args(), {})]) == []
    for j in jobs:
        i = j.cmd.index("torch.distributed.run")
        assert sys.executable not in j.cmd[i:], j.cmd  # the interpreter only before torchrun


def test_an_interpreter_before_the_script_is_refused():
    bad = rb.Job("unpatched", [*rb.torchrun(29501), sys.executable, str(BRIDGE / "bridge_pretrain.py"),
                               "--out", "/tmp/x"], rb.ROOT, {}, 29501)
    (msg,) = rb.check_commands([bad])
    assert "not a .py file" in msg
    missing = rb.Job("x", [*rb.PATCH, *rb.torchrun(29502), "nope.py"], rb.ROOT, {}, 29502)
    assert "does not exist" in rb.check_commands([missing])[0]
    clash = [rb.Job(n, [*rb.torchrun(29503), str(BRIDGE / "bridge_pretrain.py")], rb.ROOT, {}, 29503) for n in "ab"]
    assert "also used by" in rb.check_commands(clash)[0]


def test_dry_run_prints_and_checks():
    r = subprocess.run([sys.executable, "-m", "validation.frameworks.bridge.run_bridge", "--dry-run", "--tests", "bt"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "command check: ok (7 jobs)" in r.stdout


# --- a rank killed while writing its result (Bridge 0.6.2 unpatched: rank 1 fails on megatron's apex
# refusal, torchrun SIGTERMs rank 0 mid-write; a 0-byte result.rank0.json must not stop the driver
# before gradient parity and patched_timing) ---------------------------------------------------------

APEX = "RuntimeError: ColumnParallelLinear was called with gradient_accumulation_fusion set to True but ..."
LOSSES = [10.47, 10.28, 10.05, 9.84]


def record(ok: bool, **kw) -> dict:
    return {"ok": ok, "steps": [{"step": i + 1, "ms": 200.0 + i} for i in range(4 if ok else 0)],
            "losses": LOSSES if ok else [], "median_step_ms": 201.5 if ok else None, **kw}


def wave1(work: Path, empty_rank0: bytes = b"") -> None:
    """What wave 1 leaves in that case: unpatched with a cut-off rank 0 file, the others complete."""
    (work / "unpatched").mkdir(parents=True)
    (work / "unpatched" / "result.rank0.json").write_bytes(empty_rank0)
    (work / "unpatched" / "result.rank1.json").write_text(json.dumps(record(
        False, rank=1, error=APEX, traceback='  File "/x/megatron/core/tensor_parallel/layers.py", line 1071, '
                                             f'in __init__\n    raise RuntimeError(\n{APEX}\n')))
    (work / "unpatched.log").write_text(
        f"{APEX}\nRoot Cause (first observed failure):\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 7)\n"
        "  rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 8)\n")
    for n in ("patched", "off", "off_repeat"):
        (work / n).mkdir()
        (work / n / "result.json").write_text(json.dumps(record(
            True, rank=0, gradient_accumulation_fusion_in_model=n == "patched",
            dump={"path": f"/tmp/br/{n}/grads.pt", "params": 2})))


def test_read_run_passes_over_an_empty_rank0_file(tmp_path, monkeypatch):
    monkeypatch.setattr(rb, "WORK", tmp_path)
    wave1(tmp_path)
    r = rb.read_run("unpatched")
    assert (r["rank"], r["error"]) == (1, APEX)
    assert r["result_file_notes"] == ["result.rank0.json is empty (0 bytes): the rank was killed while writing"]


@pytest.mark.parametrize("content, why", [(b"", "result.rank0.json is empty (0 bytes)"),
                                          (b'{"ok": fal', "result.rank0.json is cut off or not JSON (10 bytes")])
def test_read_run_with_only_an_unreadable_file(tmp_path, monkeypatch, content, why):
    monkeypatch.setattr(rb, "WORK", tmp_path)
    (tmp_path / "unpatched").mkdir()
    (tmp_path / "unpatched" / "result.rank0.json").write_bytes(content)
    (tmp_path / "unpatched.log").write_text(APEX + "\n")
    r = rb.read_run("unpatched")
    assert r["ok"] is False and r["error"].startswith(why) and "killed while writing" in r["error"]
    assert APEX in r["log_tail"]


def test_one_unreadable_result_stops_no_stage(tmp_path, monkeypatch):
    """Gradient parity of patched vs off and the patched_timing run go ahead beside an unreadable
    unpatched result."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(rb, "WORK", tmp_path)
    wave1(tmp_path, b'{"argv": ["--iters"')
    g = {"decoder.layers.0.mlp.linear_fc1.weight": torch.ones(4, 4), "embedding.word_embeddings.weight": torch.ones(8)}
    for n, eps in (("patched", 1e-4), ("off", 0.0), ("off_repeat", 1e-4)):
        torch.save({"grads": {k: v + eps * torch.arange(v.numel()).view_as(v) for k, v in g.items()}},
                   tmp_path / n / "grads.pt")

    def run_all(jobs, deadline):  # the timing job, without a GPU
        for j in jobs:
            (tmp_path / j.name).mkdir()
            rb.write_atomic(tmp_path / j.name / "result.json", json.dumps(record(True, median_step_ms=150.25)))
            j.rc, j.wall = 0, 1.0

    monkeypatch.setattr(rb, "run_all", run_all)
    res: dict = {"jobs": {}}
    runs = rb.postprocess(res, tmp_path)
    rb.guarded(res, "patched_timing", rb.timing_stage, args("budget", 1e6), {}, set(), runs, res)
    assert "stage_errors" not in res, res["stage_errors"]
    assert res["grad_parity"]["params"] == 2 and res["grad_parity"]["passed"] is True
    assert res["patched"]["loss_max_abs_diff_vs_off"] == 0.0 and res["off"]["loss_max_abs_diff_off_repeat"] == 0.0
    assert res["unpatched"]["result_file_notes"][0].startswith("result.rank0.json is cut off or not JSON")
    assert res["unpatched_outcome"].startswith(APEX) and "layers.py:1071" in res["unpatched_outcome"]
    assert (res["patched"]["median_step_ms"], res["jobs"]["patched_timing"]["rc"]) == (150.25, 0)


def test_a_stage_that_raises_is_recorded_and_the_rest_run(tmp_path):
    wave1(tmp_path)
    (tmp_path / "off" / "result.json").write_text("[]")  # a record that is no dict
    res: dict = {}
    rb.postprocess(res, tmp_path, tests=True, parity=False)
    assert res["off"]["ok"] is False and "holds no record (list)" in res["off"]["error"]
    assert res["patched"]["ok"] is True and res["unpatched_outcome"].startswith(APEX)
    assert res["bridge_tests"]["unpatched"]["source"].startswith("log")


def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path):
    f = tmp_path / "result.json"
    rb.write_atomic(f, '{"ok": true}')
    with pytest.raises(TypeError):
        rb.write_atomic(f, None)  # fails after the temp file is opened
    assert f.read_text() == '{"ok": true}' and [p.name for p in tmp_path.iterdir()] == ["result.json"]
    assert "write_atomic(out / name," in (BRIDGE / "bridge_pretrain.py").read_text()


def test_merge_rebuilds_a_stopped_driver_from_its_logs(tmp_path):
    from validation.frameworks.bridge import merge_results as mr

    work = tmp_path / "br"
    wave1(work)
    (work / "tests_patched.junit.rank0.xml").write_text(
        '<testsuites><testsuite time="62.4"><testcase name="test_fsdp_pretrain_basic" time="19.2"/>'
        "</testsuite></testsuites>")
    with tarfile.open(tmp_path / "logs_9.9.tgz", "w:gz") as t:
        for p in sorted(work.rglob("*")):
            t.add(p, arcname=str(p.relative_to(work)))
    driver = {"bridge_version": "9.9", "megatron_core": "0.19.2", "bridge_tests_source": "bt", "notes": [],
              "driver_error": "JSONDecodeError: Expecting value: line 1 column 1 (char 0)",
              "driver_traceback": 'File "/w/validation/frameworks/bridge/run_bridge.py", line 238, in read_run\n'}
    (tmp_path / "bridge_9.9.json").write_text(json.dumps(driver))
    out = tmp_path / "bridge.json"
    assert mr.main([str(tmp_path / "bridge_9.9.json"), "--source", "test", "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["patched"]["losses"] == LOSSES and m["patched"]["median_step_ms"] is None
    assert m["patched"]["median_step_ms_concurrent"] == 201.5 and "no patched_timing run" in \
        m["patched"]["median_step_ms_not_measured"]
    gp = m["grad_parity"]
    assert (gp["params"], gp["passed"]) == (None, None)
    for part in ("JSONDecodeError", "in read_run()", "unpatched: result.rank0.json is empty (0 bytes)",
                 "rank 0 exit code -15 (SIGTERM)", "grads.pt of patched, off, off_repeat", "logs_9.9.tgz"):
        assert part in gp["not_measured"], part
    named = {t for v in mr.DRIVER_FIXED.values() for t in re.findall(r"::(test_\w+)", v)}
    assert named and named <= set(globals()), named - set(globals())
    assert m["unpatched_outcome"].startswith("Bridge 9.9's pretrain() unpatched") and APEX in m["unpatched_outcome"]
    assert (m["bridge_tests"]["passed"], m["bridge_tests"]["tests"]["test_fsdp_pretrain_basic"]["time_s"]) == (1, 19.2)
    # a later run's file beside an earlier bridge.json: the pairings it does not replace stay, with their source
    old = {"source": {"from": "first run"}, "pairings": {"bridge 0.4.2 + megatron-core 0.17.1": {
        "bridge_version": "0.4.2", "megatron_core": "0.17.1", "grad_parity": {"params": 52, "passed": True}}}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    mr.main([str(tmp_path / "bridge_9.9.json"), "--source", "second run", "--out", str(out),
             "--keep", str(tmp_path / "old.json")])
    m = json.loads(out.read_text())
    assert [(k, v["from"]) for k, v in m["pairings"].items()] == [
        ("bridge 9.9 + megatron-core 0.19.2", "second run"), ("bridge 0.4.2 + megatron-core 0.17.1", "first run")]
    assert m["bridge_version"] == "0.4.2" and m["grad_parity"]["params"] == 52  # the one with measured parity on top
