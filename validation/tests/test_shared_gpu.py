"""validation.shared_gpu: the launcher of several ranks on one GPU (real processes, a real gloo
all-reduce on the CPU), the many-rank campaign's records and verdicts from real gradient dumps
through the parity harness's comparison, and the committed table against its records."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from validation.shared_gpu import launch as launcher
from validation.shared_gpu import parity, table

torch = pytest.importorskip("torch")

RANK_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(x)
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NCCL_HOSTID", "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME",
        "OMP_NUM_THREADS")
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"sum": x.item(), "threads": torch.get_num_threads(), **{k: os.environ.get(k) for k in keys}}, f)
dist.destroy_process_group()
"""


def test_launch_starts_every_rank_on_gpu0_with_its_own_host_id(tmp_path):
    rc = launcher.launch([sys.executable, "-c", RANK_SCRIPT, str(tmp_path)], 3, log_dir=tmp_path / "logs",
                         timeout_s=120)
    assert rc == 0, [p.read_text() for p in (tmp_path / "logs").glob("*.log")]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [s["sum"] for s in seen] == [6.0, 6.0, 6.0]  # 1 + 2 + 3: a real collective over 3 ranks
    assert [s["RANK"] for s in seen] == ["0", "1", "2"]
    assert {s["WORLD_SIZE"] for s in seen} == {"3"}
    assert {s["LOCAL_RANK"] for s in seen} == {"0"} and {s["CUDA_VISIBLE_DEVICES"] for s in seen} == {"0"}
    assert len({s["NCCL_HOSTID"] for s in seen}) == 3
    assert {s["NCCL_SOCKET_IFNAME"] for s in seen} == {"lo"}
    assert {s["threads"] for s in seen} == {1}  # torchrun's default: ranks outnumber the cores


def test_a_thread_count_the_caller_set_is_kept():
    env = launcher.rank_env({"OMP_NUM_THREADS": "4"}, 0, 2, 29500)
    assert env["OMP_NUM_THREADS"] == "4" and launcher.rank_env({}, 0, 2, 29500)["OMP_NUM_THREADS"] == "1"


def test_a_failing_rank_stops_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "GRACE_S", 0.5)
    script = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)"
    t0 = time.monotonic()
    rc = launcher.launch([sys.executable, "-c", script], 2, log_dir=tmp_path, timeout_s=120)
    assert rc == 3
    assert time.monotonic() - t0 < 30


def test_timeout_stops_every_rank(tmp_path):
    rc = launcher.launch([sys.executable, "-c", "import time; time.sleep(60)"], 2, log_dir=tmp_path, timeout_s=1)
    assert rc == 124


def test_cli_refuses_a_missing_command_and_bad_rank_counts(capsys):
    with pytest.raises(SystemExit):
        launcher.main(["--ranks", "2"])
    with pytest.raises(SystemExit):
        launcher.main(["--ranks", "0", "--", "true"])
    assert "at least 1" in capsys.readouterr().err


def _save(path: Path, grads: dict[str, torch.Tensor]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": "gemm_patch.grad_dump/1", "grads": grads}, path)


def _args(scratch: Path):
    return parity.parse_args(["--out", str(scratch / "out"), "--scratch", str(scratch), "--layouts", "tied",
                              "--strategies", "optim_grads"])


def test_records_pass_fusion_off_parity_and_catch_a_lost_embedding_gradient(tmp_path):
    """Dumps as the processes write them: gemm-patch within bf16 rounding of fusion off, the
    upstream control without the tied embedding's lookup gradient (what megatron's hook drops)."""
    gen = torch.Generator().manual_seed(0)
    off = {"embedding.word_embeddings.weight": torch.randn(64, 16, generator=gen),
           "decoder.layers.0.mlp.linear_fc1.weight": torch.randn(32, 16, generator=gen)}
    lookup = 0.5 * torch.randn(64, 16, generator=gen)
    fp64 = {k: v.double() for k, v in off.items()}
    near = {k: v * (1 + 1e-3 * torch.randn(v.shape, generator=gen)) for k, v in off.items()}
    lost = {**near, "embedding.word_embeddings.weight": off["embedding.word_embeddings.weight"] - lookup}
    args = _args(tmp_path)
    for config, grads in (("fusion_off", off), ("patched", near), ("upstream", lost)):
        _save(parity.dump_file(tmp_path, "0.17.1", 2, config, "tied", "optim_grads"), grads)
    _save(parity.dump_file(tmp_path, "0.17.1", 2, "fusion_off", "tied", "fp64"), fp64)
    part = {"gpu": "NVIDIA H200", "versions": {"megatron_core": "0.17.1"}, "runs": []}
    procs = {f"tied.{c}": {"rc": 0, "part": part} for c in parity.CONFIGS}

    recs = parity.records(args, tmp_path, "0.17.1", 2, ["tied"], procs)

    by = {r["config"]: r for r in recs}
    assert by["patched"]["passed"] is True and by["patched"]["max_rel_err_vs_off"] < 1e-2
    assert by["upstream"]["passed"] is False
    assert by["upstream"]["worst_param_vs_off"] == "embedding.word_embeddings.weight"
    assert by["fusion_off"]["max_rel_err_vs_fp64"] == 0.0 and by["fusion_off"]["passed"] is None
    assert all(r["one_gpu"] and r["device"] == "NVIDIA H200" and r["ranks"] == 2 for r in recs)
    assert set(parity.RECORD_KEYS) <= set(by["patched"])
    assert "GEMM_PATCH_DISABLE" in by["upstream"]["control"]
    assert table.parity_verdict(by["patched"], by["upstream"]) == "pass (upstream wrong)"
    assert not list(tmp_path.rglob("*.pt"))  # compared, then deleted


def test_configs_run_only_those_named_and_always_fusion_off(tmp_path, capsys):
    """``--configs fusion_off,upstream``: the upstream control alone (its reference with it), no
    record for gemm-patch; a list without fusion off, or an unknown name, is refused."""
    gen = torch.Generator().manual_seed(2)
    off = {"decoder.layers.0.mlp.linear_fc1.weight": torch.randn(32, 16, generator=gen)}
    _save(parity.dump_file(tmp_path, "0.19.2", 8, "fusion_off", "tied", "optim"), off)
    _save(parity.dump_file(tmp_path, "0.19.2", 8, "upstream", "tied", "optim"), off)
    args = parity.parse_args(["--out", str(tmp_path / "out"), "--scratch", str(tmp_path), "--layouts", "tied",
                              "--strategies", "optim", "--configs", "upstream,fusion_off"])
    assert args.configs == "fusion_off,upstream"
    procs = {f"tied.{c}": {"rc": 0, "part": None} for c in ("fusion_off", "upstream")}

    recs = parity.records(args, tmp_path, "0.19.2", 8, ["tied"], procs)

    assert [r["config"] for r in recs] == ["fusion_off", "upstream"]
    assert recs[1]["passed"] is True
    for bad in ("patched,upstream", "fusion_off,fused"):
        with pytest.raises(SystemExit):
            parity.parse_args(["--out", "o", "--configs", bad])
        assert "give fusion_off" in capsys.readouterr().err


def test_records_fail_a_patched_run_that_lost_a_micro_batch_and_name_a_missing_dump(tmp_path):
    gen = torch.Generator().manual_seed(1)
    off = {"decoder.layers.0.mlp.linear_fc1.weight": torch.randn(32, 16, generator=gen)}
    _save(parity.dump_file(tmp_path, "0.19.2", 4, "fusion_off", "tied", "optim_grads"), off)
    _save(parity.dump_file(tmp_path, "0.19.2", 4, "patched", "tied", "optim_grads"),
          {k: 0.75 * v for k, v in off.items()})  # 3 of 4 micro-batches
    procs = {f"tied.{c}": {"rc": 1 if c == "upstream" else 0, "part": None} for c in parity.CONFIGS}

    by = {r["config"]: r for r in parity.records(_args(tmp_path), tmp_path, "0.19.2", 4, ["tied"], procs)}

    assert by["patched"]["passed"] is False
    assert table.parity_verdict(by["patched"], by["upstream"]) == "FAIL"
    assert by["upstream"]["passed"] is None and "rc=1" in by["upstream"]["error"]
    assert by["upstream"]["control"].startswith("megatron's own fused path")
    assert table.parity_verdict(None, None) == "no result"


def test_records_tell_a_wrong_fusion_off_reference_from_a_wrong_patched_run(tmp_path):
    """An expert gradient 4x too large in fusion off under a sharded strategy (a one-rank reduce-scatter
    that drops its 1/4 factor): patched, right, fails against that reference, and the all-reduce
    reference (fusion off under no_shard) says which of the two is wrong."""
    gen = torch.Generator().manual_seed(2)
    right = {"decoder.layers.0.mlp.experts.linear_fc1.weight0": torch.randn(32, 16, generator=gen)}
    four = {k: 4 * v for k, v in right.items()}
    for strategy, config, grads in (("no_shard", "fusion_off", right), ("no_shard", "patched", right),
                                    ("optim", "fusion_off", four), ("optim", "patched", right)):
        _save(parity.dump_file(tmp_path, "0.19.2", 4, config, "moe_ep", strategy), grads)
    args = parity.parse_args(["--out", str(tmp_path / "out"), "--scratch", str(tmp_path), "--layouts", "moe_ep",
                              "--strategies", "no_shard,optim"])
    procs = {f"moe_ep.{c}": {"rc": 0, "part": None} for c in parity.CONFIGS}

    by = {(r["strategy"], r["config"]): r for r in parity.records(args, tmp_path, "0.19.2", 4, ["moe_ep"], procs)}

    sharded_off, sharded_patched = by[("optim", "fusion_off")], by[("optim", "patched")]
    assert sharded_patched["max_rel_err_vs_off"] == pytest.approx(0.75)  # against fusion off of the same strategy
    assert sharded_patched["norm_ratio_vs_off"] == [pytest.approx(0.25)] * 2
    assert sharded_off["max_rel_err_vs_off_no_shard"] == pytest.approx(3.0)  # fusion off's own check fails
    assert sharded_off["worst_param_vs_off_no_shard"].endswith("experts.linear_fc1.weight0")
    assert sharded_off["norm_ratio_vs_off_no_shard"] == [pytest.approx(4.0)] * 2
    assert sharded_patched["reference"] == "fusion_off_no_shard"
    assert sharded_patched["max_rel_err_vs_reference"] == 0.0 and sharded_patched["passed"] is True
    assert table.parity_verdict(sharded_patched, by[("optim", "upstream")]) == \
        "pass (reference: no_shard's fusion off)"
    plain = by[("no_shard", "patched")]
    assert plain["reference"] == "fusion_off" and plain["passed"] is True
    assert by[("no_shard", "fusion_off")]["max_rel_err_vs_off_no_shard"] is None  # the reference itself


def test_a_patched_run_wrong_where_fusion_off_is_wrong_too_fails(tmp_path):
    """Both 4x on the expert (the check that both agreeing is not enough): fusion off's own check
    fails, the reference becomes fusion off under no_shard, and the patched run fails against it."""
    gen = torch.Generator().manual_seed(3)
    right = {"decoder.layers.0.mlp.experts.linear_fc1.weight0": torch.randn(32, 16, generator=gen)}
    four = {k: 4 * v for k, v in right.items()}
    for strategy, config, grads in (("no_shard", "fusion_off", right), ("optim", "fusion_off", four),
                                    ("optim", "patched", four)):
        _save(parity.dump_file(tmp_path, "0.19.2", 4, config, "moe_ep", strategy), grads)
    args = parity.parse_args(["--out", str(tmp_path / "out"), "--scratch", str(tmp_path), "--layouts", "moe_ep",
                              "--strategies", "no_shard,optim"])
    procs = {f"moe_ep.{c}": {"rc": 0, "part": None} for c in parity.CONFIGS}

    by = {(r["strategy"], r["config"]): r for r in parity.records(args, tmp_path, "0.19.2", 4, ["moe_ep"], procs)}

    patched = by[("optim", "patched")]
    assert patched["max_rel_err_vs_off"] == 0.0  # equal to fusion off of its strategy: a false pass before
    assert patched["reference"] == "fusion_off_no_shard" and patched["passed"] is False
    assert table.parity_verdict(patched, by[("optim", "upstream")]) == "FAIL"

def test_upstream_control_keeps_only_what_megatron_needs_to_run_fused():
    from gemm_patch.targets import REGISTRY

    known = {t.name for t in REGISTRY}
    env, rule, _ = parity.upstream_control("0.19.2")
    left_out = set(env["GEMM_PATCH_DISABLE"].split(","))
    assert rule is None and left_out <= known and known - left_out == {"apex-wgrad", "te-dummy-wgrad", "nemo-fsdp-gaf"}
    env, rule, _ = parity.upstream_control("0.17.1")
    left_out = set(env["GEMM_PATCH_DISABLE"].split(","))
    assert rule == "overwrite" and left_out <= known and "fsdp-wgrad" not in left_out


def test_fusion_off_runs_megatron_alone_and_the_fused_configurations_under_the_start_up_hook(monkeypatch):
    """Fusion off gets GEMM_PATCH=0 whatever the caller's environment holds (a start-up hook
    installed in the kit would otherwise load gemm_patch and its reduce fix there)."""
    monkeypatch.setenv("GEMM_PATCH_AUTO", "1")
    args = parity.parse_args(["--out", "o"])
    off = parity.process_env(args, "0.19.2", "fusion_off")
    assert off["GEMM_PATCH"] == "0" and "GEMM_PATCH_AUTO" not in off
    patched = parity.process_env(args, "0.19.2", "patched")
    assert "GEMM_PATCH" not in patched and patched["GEMM_PATCH_AUTO"] == "1"
    upstream = parity.process_env(args, "0.17.1", "upstream")
    assert upstream["GEMM_PATCH_AUTO"] == "1" and "fsdp-one-rank-scale" in upstream["GEMM_PATCH_DISABLE"]

def test_plan_puts_the_fp64_oracles_last_and_expert_parallel_equal_to_ranks(tmp_path):
    args = parity.parse_args(["--out", str(tmp_path), "--layouts", "tied_mtp,tied,moe_ep"])
    runs = parity.plan(args, tmp_path, "0.17.1", 4, "fusion_off", ["untied", "tied"])
    patched = parity.plan(args, tmp_path, "0.17.1", 4, "patched", ["untied", "tied"])
    # every configuration's training runs in the same order, each after the same run
    assert [r["name"] for r in runs[:-2]] == [r["name"] for r in patched]
    assert [r["name"] for r in runs[-2:]] == ["untied.fp64", "tied.fp64"]
    assert [r["sharding"] for r in runs[:4]] == list(parity.STRATEGIES)
    ep = parity.plan(args, tmp_path, "0.17.1", 4, "upstream", ["moe_ep"])
    assert {r["ep"] for r in ep} == {4} and {r["wgrad_rule"] for r in ep} == {"overwrite"}
    assert all(r["fusion"] == "on" and r["micro_batches"] == 4 and r["steps"] == 1 for r in ep)
    assert parity.groups(["tied", "moe_ep", "tied_mtp"]) == [("dense", ["tied", "tied_mtp"]), ("ep", ["moe_ep"])]


def test_a_process_may_run_no_later_than_the_stop_time():
    args = parity.parse_args(["--out", "o", "--proc-limit", "200"])
    assert parity.process_limit(args, args.t0 + 500) == 200  # no --stop-at: the process limit alone
    args = parity.parse_args(["--out", "o", "--proc-limit", "200", "--stop-at", "300"])
    assert parity.process_limit(args, args.t0 + 50) == 200
    assert parity.process_limit(args, args.t0 + 250) == pytest.approx(50)
    assert parity.process_limit(args, args.t0 + 400) == 1.0

def test_memory_table_shows_the_difference_to_fusion_off_and_which_step_times_count():
    base = {"kind": "memory", "entry": "train_gpt_fsdp", "release": "0.17.1", "ranks": 2, "case": "c",
            "allocated_bytes": 100 * table.MIB, "step_times_s": [1.5, 0.5, 0.4, 0.4], "alone": True}
    recs = [{**base, "config": "fusion_off", "max_allocated_bytes": 1000 * table.MIB, "order": 0},
            {**base, "config": "patched", "max_allocated_bytes": 1125 * table.MIB, "order": 1},
            {**base, "config": "patched", "max_allocated_bytes": 1125 * table.MIB, "alone": False},
            {**base, "config": "upstream", "error": "no result (rc=124)"}]
    md = table.memory_markdown(recs)
    assert "| 0.17.1 | 2 | c | patched #2 | 100.0 | 1125.0 | +125.0 | 1500 / 500 / 400 |" in md
    assert "| 0.17.1 | 2 | c | fusion_off #1 | 100.0 | 1000.0 | - |" in md
    assert "| 0.17.1 | 2 | c | patched | 100.0 | 1125.0 | +125.0 | 1500 / 500 / 400 (GPU shared) |" in md
    assert "| 0.17.1 | 2 | c | upstream | - | - | - | no result (rc=124) |" in md
    assert len({table.record_key(r) for r in recs}) == 4


def test_merge_replaces_the_same_measurement_and_writes_the_table(tmp_path):
    rec = {"entry": "train_gpt_fsdp", "release": "0.17.1", "ranks": 2, "layout": "tied", "strategy": "optim",
           "config": "patched", "max_rel_err_vs_off": 0.5, "passed": False, "bound": parity.BOUND}
    results, new = tmp_path / "r.jsonl", tmp_path / "n.jsonl"
    results.write_text(json.dumps(rec) + "\n")
    new.write_text(json.dumps({**rec, "max_rel_err_vs_off": 1e-3, "passed": True,
                               "device": "NVIDIA H100 80GB HBM3"}) + "\n")
    parity.merge([new], results)
    assert [r["passed"] for r in table.load(results)] == [True]
    # each row names the GPU its records ran on
    assert "| H100 | 0.17.1 | 2 | tied | optim | 1.0e-03 |" in results.with_suffix(".md").read_text()
    assert table.gpu({"device": "NVIDIA H200"}) == "H200" and table.gpu({}) == "-"


def test_committed_table_is_made_from_the_committed_records():
    if not table.RESULTS.exists():
        pytest.skip("no many-rank records committed yet")
    assert table.RESULTS.with_suffix(".md").read_text() == table.markdown(table.load(table.RESULTS))


FINE_GATHER_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from validation.parity.gpt_model import build_configs
run = {"main_grads_dtype": "fp32", "hidden": 64, "layers": 1, "fusion": "on", "sharding": "optim_grads",
       "lr": 1e-4, "adam_beta2": 0.95, "fine_grained_param_gather": "on"}
try:
    _, ddp, _ = build_configs(run)
    print("RESULT" + json.dumps({"flag": ddp.megatron_fsdp_enable_fine_grained_param_gather}))
except ValueError as exc:
    print("RESULT" + json.dumps({"error": str(exc)}))
"""


@pytest.mark.parametrize("rel, has_it", [("megatron-core==0.19.2", True), ("megatron-core==0.17.1", False)])
def test_fine_grained_gather_reaches_the_real_ddp_config_or_says_the_release_lacks_it(rel, has_it):
    """The layouts with fine-grained gather run only where the release has the field; the
    harness's config sets megatron-core's own field there, and elsewhere refuses by name."""
    import os
    import subprocess

    from compat import matrix

    try:
        tree = matrix.ensure_release(matrix.select([rel])[0])
    except subprocess.CalledProcessError as exc:  # no registry: nothing to test against
        pytest.skip(f"{rel} could not be installed: {exc.stderr[-300:]}")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", FINE_GATHER_CHILD, str(root)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)}, timeout=300, cwd=root)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT"):])
    version = rel.split("==")[1]
    assert (parity.layouts_for(version, ["tied_mtp_fine_gather", "tied"]) == ["tied_mtp_fine_gather", "tied"]) \
        is has_it
    if has_it:
        assert out == {"flag": True}
    else:
        assert "megatron_fsdp_enable_fine_grained_param_gather" in out["error"]


def test_plan_and_records_carry_fine_grained_gather_and_memory(tmp_path):
    """A fine-grained layout's runs set the run key; its records say whether Megatron-FSDP's hook
    was on and hold each configuration's memory above its process's baseline, which the table
    shows against fusion off's."""
    args = parity.parse_args(["--out", str(tmp_path), "--layouts", "tied_mtp_fine_gather", "--strategies",
                              "optim_grads", "--fp64", "off"])
    runs = parity.plan(args, tmp_path, "0.19.2", 2, "fusion_off", ["tied_mtp_fine_gather", "tied"])
    assert [r["name"] for r in runs] == ["tied_mtp_fine_gather.optim_grads", "tied.optim_grads"]  # no fp64
    assert runs[0]["fine_grained_param_gather"] == "on" and "fine_grained_param_gather" not in runs[1]
    gen = torch.Generator().manual_seed(2)
    off = {"embedding.word_embeddings.weight": torch.randn(64, 16, generator=gen)}
    for config in parity.CONFIGS:
        _save(parity.dump_file(tmp_path, "0.19.2", 2, config, "tied_mtp_fine_gather", "optim_grads"), off)

    def part(peak_mib: int) -> dict:
        run = {"name": "tied_mtp_fine_gather.optim_grads", "fine_grained_param_gather_hook": True,
               "summary": {"mem_baseline_bytes": 10 * table.MIB, "peak_mem_above_baseline_bytes": peak_mib * table.MIB},
               "steps": [{"allocated_bytes": 60 * table.MIB}]}
        return {"gpu": "NVIDIA H200", "versions": {"megatron_core": "0.19.2"}, "runs": [run]}

    procs = {f"tied_mtp_fine_gather.{c}": {"rc": 0, "part": part(p)}
             for c, p in (("fusion_off", 100), ("patched", 100), ("upstream", 228))}
    by = {r["config"]: r for r in parity.records(args, tmp_path, "0.19.2", 2, ["tied_mtp_fine_gather"], procs)}
    assert by["patched"]["fine_grained_param_gather"] is True and by["patched"]["passed"] is True
    assert by["patched"]["allocated_bytes"] == 50 * table.MIB
    assert table.memory_vs_off(by["patched"], by["fusion_off"]) == "+0.0 / +0.0"
    assert table.memory_vs_off(by["upstream"], by["fusion_off"]) == "+0.0 / +128.0"
    md = table.parity_markdown(by.values())
    assert "| 0.19.2 | 2 | tied_mtp_fine_gather | optim_grads | 0.0e+00 |" in md and "+0.0 / +128.0" in md
    assert by["patched"]["previous_run"] is None


def test_memory_is_not_compared_where_the_runs_before_differ(tmp_path):
    """What a run leaves allocated is in the next run's baseline: after a different run (fusion
    off's fp64 oracle, where it ran first) the two baselines differ and the table says so
    instead of showing a difference that is not the configuration's."""
    args = parity.parse_args(["--out", str(tmp_path), "--layouts", "untied", "--strategies", "no_shard,optim"])
    off = {"decoder.layers.0.mlp.linear_fc1.weight": torch.ones(8, 8)}
    for config in parity.CONFIGS:
        for strategy in ("no_shard", "optim"):
            _save(parity.dump_file(tmp_path, "0.17.1", 4, config, "untied", strategy), off)

    def run(name: str, base_mib: int) -> dict:
        return {"name": name, "summary": {"mem_baseline_bytes": base_mib * table.MIB,
                                          "peak_mem_above_baseline_bytes": (300 - base_mib) * table.MIB},
                "steps": [{"allocated_bytes": 300 * table.MIB}]}

    # fusion off ran the oracle first: it left 96 MiB that the first training run then did not allocate
    off_part = {"runs": [run("untied.fp64", 96), run("untied.no_shard", 96), run("untied.optim", 96)]}
    fused = {"runs": [run("untied.no_shard", 0), run("untied.optim", 96)]}
    procs = {"untied.fusion_off": {"rc": 0, "part": off_part}, "untied.patched": {"rc": 0, "part": fused},
             "untied.upstream": {"rc": 0, "part": fused}}
    recs = parity.records(args, tmp_path, "0.17.1", 4, ["untied"], procs)
    by = {(r["config"], r["strategy"]): r for r in recs}
    assert by[("fusion_off", "no_shard")]["previous_run"] == "untied.fp64"
    assert by[("patched", "no_shard")]["previous_run"] is None
    assert table.memory_vs_off(by[("patched", "no_shard")], by[("fusion_off", "no_shard")]) == "- (order)"
    assert table.memory_vs_off(by[("patched", "optim")], by[("fusion_off", "optim")]) == "+0.0 / +0.0"


def test_a_larger_model_is_its_own_measurement_and_its_own_table():
    rec = {"entry": "train_gpt_fsdp", "release": "0.19.2", "ranks": 2, "layout": "tied", "strategy": "optim",
           "config": "patched", "max_rel_err_vs_off": 1e-3, "passed": True, "bound": parity.BOUND,
           "model": dict(table.DEFAULT_MODEL)}
    big = {**rec, "model": {"layers": 4, "hidden": 1024, "seq": 1024, "vocab": 32000}}
    assert table.record_key(rec) != table.record_key(big)
    md = table.parity_markdown([rec, big])
    assert md.count("| release | ranks |") == 2
    assert "Model: hidden 1024, vocab 32000, seq 1024, 4 layers." in md
    assert "memory vs fusion off" not in md  # records without memory: no memory columns


def test_case_of_two_gpus_names_each_and_compares_no_memory_across_them():
    off = {"config": "fusion_off", "device": "NVIDIA H200", "allocated_bytes": 0, "max_allocated_bytes": 0}
    patched = {**off, "config": "patched", "max_allocated_bytes": table.MIB}
    upstream = {**off, "config": "upstream", "device": "NVIDIA H100 80GB HBM3"}
    assert table.case_gpu({"fusion_off": off, "patched": patched}) == "H200"
    assert table.case_gpu({"fusion_off": off, "patched": patched, "upstream": upstream}) == "H200; upstream H100"
    assert table.memory_vs_off(patched, off) == "+0.0 / +1.0"
    assert table.memory_vs_off(upstream, off) == "- (other GPU)"
    assert table.memory_vs_off({"config": "upstream", "error": "no gradient dump"}, off) == "-"
