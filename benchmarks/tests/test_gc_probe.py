"""benchmarks/gc_probe.py in a real subprocess: the script runs as ``python SCRIPT`` would run it, every
collection is timed, and the reading beside a megatron-format log puts each in its logged iteration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from benchmarks import gc_probe

ROOT = Path(__file__).resolve().parents[2]

# Logs megatron's iteration line (its timestamp format) for iterations 1..4; before the lines of
# iterations 3 and 4 it runs one full collection over many live objects (FULL per interval), with
# the automatic collector off: the probe must see exactly those, in those intervals.
SCRIPT = textwrap.dedent("""
    import datetime, gc, json, sys
    gc.disable()
    live = [[i] for i in range(300_000)]
    full = {int(k): v for k, v in json.loads(sys.argv[1]).items()}
    for it in range(1, 5):
        for _ in range(full.get(it, 0)):
            gc.collect()
        stamp = datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')
        print(f" [{stamp}] iteration {it:8d}/       4 | elapsed time per iteration (ms): 10.0 |", flush=True)
    print(json.dumps({"argv": sys.argv, "name": __name__}))
""")


def probe(tmp_path: Path, full: dict[int, int], env_file: bool = True) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "gc.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(gc_probe.ENV, None)
    if env_file:
        env[gc_probe.ENV] = str(out)
    done = subprocess.run([sys.executable, "-m", "benchmarks.gc_probe", str(script), json.dumps(full)],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done, out


def test_each_collection_is_timed_in_its_logged_iteration(tmp_path):
    done, out = probe(tmp_path, {3: 1, 4: 2})
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["name"] == "__main__" and seen["argv"][0].endswith("train.py") and len(seen["argv"]) == 2
    reading = gc_probe.reading(done.stdout, out.read_text())
    assert reading["from_iteration"] == 1 and reading["to_iteration"] == 4
    assert reading["by_generation"]["2"]["count"] == 3  # the three explicit ones, none automatic
    assert [(row[0], row[2]) for row in reading["by_iteration"]] == [(2, 0), (3, 1), (4, 2)]
    assert reading["by_iteration"][0][1] == 0.0 and reading["by_iteration"][2][1] > reading["by_iteration"][1][1] > 0
    assert abs(reading["ms"] - sum(row[1] for row in reading["by_iteration"])) < 0.01  # each row rounded
    assert reading["ms_per_step"] == round(reading["ms"] / 3, 3) and reading["longest_ms"] > 0


def test_a_process_that_never_collects_reads_no_collector_time(tmp_path):
    done, out = probe(tmp_path, {})
    reading = gc_probe.reading(done.stdout, out.read_text())
    assert reading["ms"] == 0.0 and reading["longest_ms"] == 0.0
    assert all(g["count"] == 0 for g in reading["by_generation"].values())


def test_without_the_variable_the_script_only_runs(tmp_path):
    done, out = probe(tmp_path, {2: 1}, env_file=False)
    assert "iteration        4/" in done.stdout and not out.exists()


def test_bad_invocations_say_what_is_expected(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bare = subprocess.run([sys.executable, "-m", "benchmarks.gc_probe"], env=env, capture_output=True, text=True)
    assert bare.returncode == 2 and "usage: python -m benchmarks.gc_probe SCRIPT" in bare.stderr
    missing = subprocess.run([sys.executable, "-m", "benchmarks.gc_probe", str(tmp_path / "nope.py")], env=env,
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "is not a file: expected the script to run" in missing.stderr
    (tmp_path / "train.py").write_text("")
    elsewhere = subprocess.run([sys.executable, "-m", "benchmarks.gc_probe", str(tmp_path / "train.py")], env=env,
                               capture_output=True, text=True, cwd=ROOT)
    assert elsewhere.returncode == 2 and "run it from" in elsewhere.stderr


def test_no_reading_without_two_iteration_lines_or_a_probe_file():
    line = " [2026-12-08 02:00:00.000000] iteration        1/       4 |"
    assert gc_probe.reading(line, json.dumps({"collections": []})) is None
    assert gc_probe.reading(line + "\n" + line.replace("1/", "2/"), "not json") is None
