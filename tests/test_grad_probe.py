"""The read-only gradient probe (gemm_patch/engine/grad_probe.py) and compare's per-parameter judgement,
on megatron-core's real layers, DistributedDataParallel and finalize_model_grads
(tests/probes/megatron_pretrain.py; megatron-core 0.14.0, 0.17.1 and 0.19.2 for the hook, the
matrix's test release for the rest), in one process and on two gloo ranks under torchrun."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
from process_env import MEGATRON_RELEASE, ROOT, free_port, gemm_patch_command, matrix

from gemm_patch.commands import compare_params
from gemm_patch.commands.launcher import launch_env
from gemm_patch.engine import grad_probe

pytest.importorskip("torch")
STAND_IN = str(ROOT / "tests" / "probes" / "megatron_pretrain.py")


def megatron_env(release: str = MEGATRON_RELEASE, **variables: str) -> dict[str, str]:
    """That release alone importable, with gemm_patch and the stand-in's folder; no GEMM_PATCH_* of ours."""
    env = {k: v for k, v in matrix.release_env(release).items() if not k.startswith("GEMM_PATCH")}
    env.update(PYTHONPATH=f"{env['PYTHONPATH']}:{ROOT}", PYTHONWARNINGS="ignore", **variables)
    return env


def compare(tmp_path: Path, release: str, *command: str, **variables: str) -> tuple[int, dict]:
    proc = subprocess.run([*gemm_patch_command(), "compare", "--logs", str(tmp_path), "--json", "--", *command],
                          env=megatron_env(release, **variables), capture_output=True, text=True, timeout=600)
    assert proc.stdout.startswith("{"), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def stand_in_compare(tmp_path_factory):
    """compare's result for the stand-in run alone on a release, with the fault given (None: none);
    each (release, fault) run once for the tests that read it (a run's result is only read)."""
    done: dict[tuple[str, str | None], tuple[int, dict]] = {}

    def run(release: str, fault: str | None = None) -> tuple[int, dict]:
        if (release, fault) not in done:
            folder = tmp_path_factory.mktemp(f"compare-{release}-{fault or 'same'}")
            variables = {"MEGATRON_PRETRAIN_FAULT": fault} if fault else {}
            done[release, fault] = compare(folder, release, sys.executable, STAND_IN, **variables)
        return done[release, fault]
    return run


@pytest.mark.parametrize("release", ["0.14.0", "0.17.1", "0.19.2"])
def test_each_parameter_judged_and_one_lost_parameter_differs_where_the_global_norm_agrees(stand_in_compare, release):
    code, same = stand_in_compare(release)
    assert code == 0 and same["verdict"] == "same", same["summary"]
    params = same["parameters"]
    assert params["judged"] and params["count"] == 3 and params["differs"] == []
    assert params["worst"]["rel"] < compare_params.BF16_BOUND  # the bf16 rounding of fusion off only
    assert same["runs"]["off"]["env"]["GEMM_PATCH"] == "0" and same["runs"]["off"]["probe"]["ranks"] == [0]

    code, lost = stand_in_compare(release, "lose_scale")
    assert code == 1 and lost["verdict"] == "differs", lost["summary"]
    assert lost["summary"].startswith("differs at iteration 1: parameter module.scale: ")
    assert lost["first_difference"]["iteration"] == 1 and lost["first_difference"]["parameter"] == "module.scale"
    assert all(not r["differs"] for r in lost["rows"])  # megatron's loss and grad norm alone: no difference
    assert lost["rows"][0]["grad_norm"][0] == lost["rows"][0]["grad_norm"][1]


def test_a_defect_from_the_second_step_is_named_at_iteration_2(stand_in_compare):
    """A main grad not zeroed between steps (the first step's gradient of ``scale`` carried into the
    second) shows neither at iteration 1 nor in the global values: the probe's second-step records,
    judged against the perturbed fusion-off run compare makes, name it at iteration 2; the same runs
    without the fault are "same" with iteration 2 judged."""
    code, same = stand_in_compare(MEGATRON_RELEASE)
    assert code == 0 and same["parameters_step2"]["judged"] and not same["parameters_step2"]["differs"], same["summary"]
    assert same["runs"]["off_repeat1"]["env"][grad_probe.PERTURB_ENV] == repr(2.0 ** -8)
    code, kept = stand_in_compare(MEGATRON_RELEASE, "keep_scale")
    assert code == 1 and kept["summary"].startswith("differs at iteration 2: parameter module.scale: "), kept["summary"]
    assert kept["first_difference"]["iteration"] == 2


def probe_records(tmp_path: Path, *options: str) -> dict[int, dict]:
    """The first step's records, by rank."""
    folder = tmp_path / "probe"
    env = launch_env(megatron_env(**{grad_probe.ENV: str(folder)}))  # as compare starts each run
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), STAND_IN, "--train-iters", "1", *options],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return grad_probe.by_iteration(grad_probe.read(str(folder)))[0][1]


def test_two_ranks_the_distributed_optimizers_shards_are_combined(tmp_path):
    """The same gradients reduced by all-reduce (whole on each rank) and by reduce-scatter (one
    shard per rank, a parameter cut between the two): the same record on both ranks."""
    whole = probe_records(tmp_path / "all_reduce")
    sharded = probe_records(tmp_path / "reduce_scatter", "--use-distributed-optimizer")
    assert sorted(whole) == sorted(sharded) == [0, 1]
    for rank in (0, 1):
        a, b = whole[rank]["parameters"], sharded[rank]["parameters"]
        assert sorted(a) == sorted(b) == ["module.fc1.weight", "module.fc2.weight", "module.scale"]
        for name in a:
            assert b[name]["norm"] == pytest.approx(a[name]["norm"], rel=1e-9, abs=1e-12), name
            assert b[name]["projections"] == pytest.approx(a[name]["projections"], rel=1e-9, abs=1e-9), name
            assert compare_params.rel(b[name], a[name]) < 1e-9
        assert whole[rank]["gemm_patch"]["applied"] and whole[rank]["hook"].endswith("finalize_model_grads")


def test_projections_estimate_the_relative_difference():
    """rel() from the records of two gradients against their true ||g - g_ref|| / ||g_ref||."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    g_ref = torch.randn(5000, generator=gen, dtype=torch.float64)
    for scale in (2.0 ** -9, 0.05, 0.5):
        g = g_ref + scale * torch.randn(5000, generator=gen, dtype=torch.float64)
        true = ((g - g_ref).norm() / g_ref.norm()).item()

        def rec(t):
            values = grad_probe.contribution(t, 0).tolist()
            return {"norm": math.sqrt(values[0]), "projections": values[1:]}
        assert true / 3 < compare_params.rel(rec(g), rec(g_ref)) < 3 * true, scale


def test_dtensor_gradients_are_recorded_as_each_ranks_block(tmp_path):
    """Megatron-FSDP's parameters after finish_grad_sync: DTensors, each rank one block of rows of the
    reduced gradient (uneven, one rank's empty, not where torch's own chunking puts them) or a
    replicated one; each rank records its own block, and the blocks make up the whole."""
    env = megatron_env()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(ROOT / "tests" / "probes" / "dtensor_probe.py"),
                           str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert len(lines) == 2
    rows = {name: sorted(line["local_rows"][name] for line in lines) for name in lines[0]["local_rows"]}
    assert rows == {"even": [3, 4], "empty": [0, 7], "uneven": [2, 5], "rep": [7, 7]}
    for line in lines:
        rec = line["record"]
        assert "error" not in rec and rec["without_gradient"] == [] and rec["not_recorded"] == {}, rec
        for name, expected in line["expected"].items():
            got = rec["parameters"][name]
            assert got["norm"] == pytest.approx(math.sqrt(expected[0]), rel=1e-12, abs=1e-12), name
            assert got["projections"] == pytest.approx(expected[1:], rel=1e-12, abs=1e-12), name
            assert rec["blocks"][name] == {"rows": line["local_rows"][name[:-len(".weight")]], "of": 7}
    for name, norm in lines[0]["whole_norms"].items():
        blocks = [line["record"]["parameters"][name]["norm"] for line in lines]
        whole = math.sqrt(sum(b * b for b in blocks)) if name != "rep.weight" else blocks[0]
        assert whole == pytest.approx(norm, rel=1e-9), name


def test_two_ranks_under_torchrun_a_lost_parameter_is_named_with_its_rank(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), STAND_IN, "--use-distributed-optimizer"]
    code, lost = compare(tmp_path, MEGATRON_RELEASE, *command, MEGATRON_PRETRAIN_FAULT="lose_scale")
    assert code == 1 and lost["runs"]["on"]["probe"]["ranks"] == [0, 1], lost["summary"]
    assert lost["summary"].startswith("differs at iteration 1: parameter module.scale (rank ")
    assert lost["first_difference"]["parameter"] == "module.scale"


def test_off_nothing_is_wrapped_and_on_the_training_is_unchanged(tmp_path):
    """Without GEMM_PATCH_GRAD_PROBE, megatron's finalize_model_grads is its own function; with it,
    every logged value of the run is what it is without (the probe only reads)."""
    check = ("import gemm_patch, wrapt; from megatron.core.distributed import finalize_model_grads as f; "
             "print(type(f).__name__)")
    proc = subprocess.run([sys.executable, "-c", check], env=megatron_env(), capture_output=True, text=True)
    assert proc.stdout.strip() == "function", proc.stderr[-2000:]

    def iteration_lines(**variables: str) -> list[str]:
        out = subprocess.run([sys.executable, STAND_IN, "--train-iters", "3"],
                             env=launch_env(megatron_env(**variables)), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return [line for line in out.stdout.splitlines() if " iteration " in line]
    folder = tmp_path / "probe"
    assert iteration_lines(**{grad_probe.ENV: str(folder)}) == iteration_lines()
    assert sorted((rec["rank"], rec["call"]) for rec in grad_probe.read(str(folder))) == [(0, 1), (0, 2)]


def test_a_restarted_worker_writes_records_of_its_own_placed_by_iteration(tmp_path):
    """A worker that fails and is started again (torchrun --max-restarts, a requeue) starts the
    probe's count again: its records are files of their own beside the first worker's, never over
    them. Where megatron's arguments give the iteration they are placed there; where nothing gives
    it (a framework without megatron.training) the restarted worker's cannot be placed."""
    def run(folder: Path, *options: str, **variables: str) -> None:
        env = launch_env(megatron_env(**{grad_probe.ENV: str(folder)}, **variables))
        proc = subprocess.run([sys.executable, STAND_IN, *options], env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    known = tmp_path / "known"
    run(known, "--megatron-args", "--train-iters", "2")
    run(known, "--megatron-args", "--start-iteration", "3", "--train-iters", "4", TORCHELASTIC_RESTART_COUNT="1")
    records = grad_probe.read(str(known))
    assert sorted((rec["iteration"], rec["call"]) for rec in records) == [(1, 1), (2, 2), (3, 1), (4, 2)]
    placed, unplaced = grad_probe.by_iteration(records)
    assert sorted(placed) == [1, 2, 3, 4] and unplaced == []
    assert placed[3][0]["process"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert "TORCHELASTIC_RESTART_COUNT" not in placed[1][0]["process"]
    assert placed[1][0]["parameters"] != placed[3][0]["parameters"]

    unknown = tmp_path / "unknown"
    run(unknown, "--train-iters", "2")
    run(unknown, "--start-iteration", "3", "--train-iters", "4", TORCHELASTIC_RESTART_COUNT="1")
    placed, unplaced = grad_probe.by_iteration(grad_probe.read(str(unknown)))
    assert sorted(placed) == [1, 2] and all(rec["process"]["TORCHELASTIC_RESTART_COUNT"] == "1" for rec in unplaced)
    assert sorted(rec["call"] for rec in unplaced) == [1, 2]


def test_records_are_placed_by_iteration_and_older_records_are_read(tmp_path, monkeypatch):
    """by_iteration's rules on written records: an iteration done twice on a rank (a restart that
    went back to an earlier checkpoint) keeps the first process's record; a record without a
    call (``rank<R>.json``, ``step2/rank<R>.json``, as records were written before they said it)
    is the first or second step; megatron's iteration is read from its arguments where set."""
    def rec(rank: int, call: int, iteration: int | None, pid: int, started: float, norm: float) -> dict:
        return {"rank": rank, "parameters": {"w": {"numel": 1, "norm": norm, "projections": [norm] * 8}},
                "call": call, "iteration": iteration, "process": {"pid": pid, "started": started}}

    for r in (rec(0, 1, 1, 7, 1.0, 1.0), rec(0, 2, 2, 7, 1.0, 2.0), rec(0, 1, 2, 9, 5.0, 2.5),
              rec(0, 2, 3, 9, 5.0, 3.0), rec(1, 1, 1, 8, 1.0, 1.0)):
        grad_probe.write(str(tmp_path / "again"), r)
    placed, unplaced = grad_probe.by_iteration(grad_probe.read(str(tmp_path / "again")))
    assert {n: {rank: r["parameters"]["w"]["norm"] for rank, r in by_rank.items()} for n, by_rank in placed.items()} \
        == {1: {0: 1.0, 1: 1.0}, 2: {0: 2.0}, 3: {0: 3.0}} and unplaced == []

    old = tmp_path / "old"
    (old / grad_probe.STEP2).mkdir(parents=True)
    (old / "rank0.json").write_text(json.dumps({"schema": 1, "rank": 0, "parameters": {}}))
    (old / grad_probe.STEP2 / "rank0.json").write_text(json.dumps({"schema": 1, "rank": 0, "parameters": {}}))
    placed, unplaced = grad_probe.by_iteration(grad_probe.read(str(old)))
    assert sorted(placed) == [1, 2] and unplaced == [] and len(grad_probe.files(str(old))) == 2

    assert grad_probe.megatron_iteration() is None
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars",
                        types.SimpleNamespace(_GLOBAL_ARGS=types.SimpleNamespace(curr_iteration=2)))
    assert grad_probe.megatron_iteration() == 3
