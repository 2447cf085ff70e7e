"""validation/parity/run_coverage.py's campaign logic on the CPU, without megatron: the plans
per layout, the rows from synthetic gradient dumps (parity, the before/after expert ratio,
megatron's refusals, missing dumps) and the merge into the results list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from validation.parity import layouts_campaign as LC
from validation.parity import run_coverage as rc

torch = pytest.importorskip("torch")
PARITY = Path(__file__).resolve().parents[1] / "parity"

EXPERT = "decoder.layers.0.mlp.experts.linear_fc1.weight0"
DENSE = "decoder.layers.0.self_attention.linear_qkv.weight"


def args_for(tmp_path, *extra):
    return rc.parse_args(["--out", str(tmp_path / "out"), "--scratch", str(tmp_path), "--results",
                          str(tmp_path / "results"), *extra])


def test_plans_cover_every_layout_and_leave_one_target_out_for_before(tmp_path):
    for sub in ("plans", "parts", "logs", "dumps"):
        (tmp_path / sub).mkdir()
    procs = rc.make_layout_processes(args_for(tmp_path), tmp_path)
    names = {p["name"] for p in procs}
    # 6 layouts x (off, off_repeat, after) x 2 releases, + before for the 2 MoE layouts x 2 releases
    assert len(procs) == 2 * (6 * 3 + 2)
    assert "0.19.2.dp1_moe.before" in names and "0.19.2.dp1.before" not in names
    before = next(p for p in procs if p["name"] == "0.19.2.ep2_moe.before")
    assert before["env"] == {"GEMM_PATCH_DISABLE": "fsdp-one-rank-scale"}
    dp1_before = next(p for p in procs if p["name"] == "0.19.2.dp1_moe.before")
    assert dp1_before["env"] == {"GEMM_PATCH_DISABLE": "moe-te-overwrite"}
    assert before["cmd"][1:4] == ["-m", "gemm_patch", "run"] and before["cmd"][-1] == "--require-patch"
    after = next(p for p in procs if p["name"] == "0.19.2.ep2_moe.after")
    assert after["env"] == {}  # every target
    off = next(p for p in procs if p["name"] == "0.17.1.tp2_sp.off")
    assert "gemm_patch" not in off["cmd"] and off["env"] == {}
    assert {(r["tp"], r["sequence_parallel"]) for r in off["plan"]} == {(2, "on")}
    assert [r["name"] for r in off["plan"][:2]] == ["off.autograd.m4", "off.autograd.m1"]
    dp2 = next(p for p in procs if p["name"] == "0.17.1.dp2.after")
    runs = {r["name"]: r for r in dp2["plan"]}
    assert runs["after.optim_grads_params+double_buffer.m4"]["double_buffer"] == "on"
    assert runs["after.optim_grads+no_overlap.m1"]["overlap"] == "off"
    moe17 = next(p for p in procs if p["name"] == "0.17.1.dp1_moe.after")["plan"]
    moe19 = next(p for p in procs if p["name"] == "0.19.2.dp1_moe.after")["plan"]
    assert {r["moe_fused"] for r in moe17} == {"off"}  # 0.17 has no fused grouped MLP
    assert {r["moe_fused"] for r in moe19} == {"on", "off"}  # fused, and the unfused variant
    assert all(r["steps"] == 1 for p in procs for r in p["plan"])
    assert procs[0]["gpus"] == 2  # two-GPU processes start first


def test_smoke_runs_each_new_layout_once_on_the_last_release(tmp_path):
    for sub in ("plans", "parts", "logs", "dumps"):
        (tmp_path / sub).mkdir()
    procs = rc.make_layout_processes(args_for(tmp_path, "--smoke"), tmp_path)
    assert {p["release"] for p in procs} == {"0.19.2"}
    assert {p["layout"] for p in procs} == set(LC.SMOKE_LAYOUTS)
    assert {r["micro_batches"] for p in procs for r in p["plan"]} == {1}
    assert sorted(p["config"] for p in procs if p["layout"] == "dp1_moe") == ["after", "before", "off"]


def _save(scratch, rel, layout, config, what, m, grads):
    path = rc.dump_path(scratch, rel, layout, config, what, m)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": "gemm_patch.grad_dump/1", "grads": grads}, path)


def test_rows_from_synthetic_dumps(tmp_path):
    g = torch.Generator().manual_seed(0)
    ref = {DENSE: torch.randn(64, 32, generator=g), EXPERT: torch.randn(48, 32, generator=g)}

    def noisy(scale=1e-4, expert_factor=1.0):
        out = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in ref.items()}
        out[EXPERT] = out[EXPERT] * expert_factor
        return out

    rel, layout = "0.19.2", "dp1_moe"
    for config, grads in (("off", ref), ("off_repeat", noisy()), ("after", noisy(1e-3)),
                          ("before", noisy(1e-3, expert_factor=0.25))):
        _save(tmp_path, rel, layout, config, "optim_grads_params", 1, grads)
    _save(tmp_path, rel, layout, "off", "autograd", 1, noisy())
    _save(tmp_path, rel, layout, "off_repeat", "autograd", 1, noisy())
    procs = [{"name": f"{rel}.{layout}.{c}", "release": rel, "layout": layout, "config": c, "rc": 0}
             for c in ("off", "off_repeat", "after", "before")]
    procs += [{"name": f"{rel}.cp2.{c}", "release": rel, "layout": "cp2", "config": c, "rc": 1}
              for c in ("off", "after")]
    parts = {p["name"]: {"runs": [{"name": "after.optim_grads_params.m1", "moe_path": ["fused grouped MLP"]}]}
             for p in procs if p["layout"] == layout}
    parts[f"{rel}.cp2.off"] = {"runs": [{"name": "off.optim_grads_params.m1",
                                         "unsupported": "AssertionError: CP is not supported", "raised_in": "x"}]}
    cache = {}
    rows, _ = LC.assemble(procs, parts, lambda *a: rc.dump_path(tmp_path, *a),
                           lambda p: rc.load_dump(p, cache), rc.compare, smoke=True)
    by = {(r["layout"], r.get("config"), r.get("oracle")): r for r in rows}
    assert by[(layout, "after", "fusion_off")]["passed"] is True
    assert by[(layout, "after", "autograd")]["passed"] is True
    assert by[(layout, "off", "autograd")]["passed"] is True
    before = by[(layout, "before", "fusion_off")]
    assert before["passed"] is False and before["expert_min_norm_ratio"] == pytest.approx(0.25, rel=1e-2)
    assert before["worst_param"] == EXPERT and by[(layout, "after", "fusion_off")]["moe"] is True
    cp = [r for r in rows if r["layout"] == "cp2"]
    assert len(cp) == 1 and cp[0]["unsupported"].startswith("AssertionError") and cp[0]["passed"] is None
    # A perturbation of 1% in the fused run is caught (the bound is 2^-7 ~ 0.8%).
    _save(tmp_path, rel, layout, "after", "optim_grads_params", 1,
          {k: v * 1.02 for k, v in ref.items()})
    rows, _ = LC.assemble(procs[:4], parts, lambda *a: rc.dump_path(tmp_path, *a),
                           lambda p: rc.load_dump(p, {}), rc.compare, smoke=True)
    assert not any(r["passed"] for r in rows if r["config"] == "after")
    # A dump that never came (a process killed at its limit) is an error row, not a silent gap.
    rc.dump_path(tmp_path, rel, layout, "after", "optim_grads_params", 1).unlink()
    rows, _ = LC.assemble(procs[:4], parts, lambda *a: rc.dump_path(tmp_path, *a),
                           lambda p: rc.load_dump(p, {}), rc.compare, smoke=True)
    after = [r for r in rows if r["config"] == "after"]
    assert after and all(r["passed"] is False and "dump missing" in r["error"] for r in after)


def test_merge_replaces_same_keys_and_keeps_the_rest(tmp_path):
    base = {"campaign": "layouts", "release": "0.19.2", "layout": "cp2", "strategy": "no_shard", "variant": "",
            "micro_batches": 4, "config": "after", "oracle": "autograd", "max_rel_diff": 1e-3, "passed": True}
    old = [{**base, "campaign": "tied-weights", "layout": "dp1_tied"}, base,
           {**base, "strategy": "optim_grads_params", "oracle": None, "error": "crash", "passed": False}]
    new = [{**base, "max_rel_diff": 2e-3}, {**base, "strategy": "optim_grads_params", "max_rel_diff": 5e-4}]
    rows = LC.merge_rows(old, new)
    assert len(rows) == 3  # tied-weights row kept, cp2 no_shard replaced, the old error row dropped
    assert {r["campaign"] for r in rows} == {"layouts", "tied-weights"}
    assert next(r for r in rows if r["strategy"] == "no_shard" and r["campaign"] == "layouts")["max_rel_diff"] == 2e-3
    assert not any(r.get("error") for r in rows)
    # Written and merged through the results folder: an old dict-form coverage.json is converted.
    results = tmp_path / "results"
    results.mkdir()
    (results / "coverage.json").write_text(json.dumps({"campaign": "tied-weights", "schema": "s", "records": [],
                                                       "rows": [{k: v for k, v in old[0].items() if k != "campaign"}]}))
    out = rc.write_results(results, results, new, {"layouts_run": {"smoke": False}})
    assert json.loads((results / "coverage.json").read_text()) == out and len(out) == 3
    runs = json.loads((results / "coverage_runs.json").read_text())
    assert runs["tied-weights"]["schema"] == "s" and runs["layouts"]["runs"] == [{"smoke": False}]
    assert "cp2" in (results / "coverage.md").read_text()


def test_model_variants_get_their_own_autograd_oracle_and_recompute_runs_on_019_moe():
    model = {"layers": 2}
    plan = LC.plan_for("dp1_moe", "0.19.2", "off", model, lambda c, w, m: f"{c}.{w}.m{m}")
    oracles = {(r["name"], r["moe_fused"]) for r in plan if r["mode"] == "autograd"}
    assert oracles == {("off.autograd.m4", "on"), ("off.autograd.m1", "on"),
                       ("off.autograd+unfused.m4", "off"), ("off.autograd+unfused.m1", "off")}
    names = {r["name"] for r in plan if r["mode"] == "train"}
    assert "off.optim_grads_params+recompute.m4" in names
    assert LC.oracle_what("unfused") == "autograd+unfused" and LC.oracle_what("recompute") == "autograd"
    plan17 = LC.plan_for("dp1_moe", "0.17.1", "off", model, lambda c, w, m: f"{c}.{w}.m{m}")
    assert not any("unfused" in r["name"] or "recompute" in r["name"] for r in plan17)


def test_known_causes_annotate_failing_rows_without_passing_them():
    base = {"campaign": "layouts", "release": "0.17.1", "strategy": "optim_grads_params", "variant": "",
            "micro_batches": 4,
            "config": "off", "oracle": "autograd", "moe": True, "passed": False, "max_rel_diff": 1.0}
    ep = {**base, "layout": "ep2_moe", "expert_min_norm_ratio": 2.0, "expert_max_norm_ratio": 2.0, "harness": 2}
    cp = {**base, "layout": "cp2", "moe": False}  # made before the harness fixes: no 'harness' key
    ok = {**ep, "passed": True}
    ns = {**ep, "strategy": "no_shard"}
    out = LC.annotate([ep, cp, ok, ns, {**cp, "harness": 2}])
    assert out[0]["upstream"].startswith("upstream") and out[0]["passed"] is False
    assert "harness_issue" not in out[0]
    assert out[1]["harness_issue"].startswith("harness") and "upstream" not in out[1]
    assert "upstream" not in out[2] and "upstream" not in out[3]
    assert "harness_issue" not in out[4]  # a rerun's failure is not explained away
    md = LC.markdown(out)
    assert "upstream" in md and "Known causes" in md


def test_ep2_after_vs_the_buggy_oracle_is_annotated_and_before_leaves_out_the_one_rank_target():
    row = {"campaign": "layouts", "release": "0.19.2", "layout": "ep2_moe", "strategy": "optim_grads_params",
           "variant": "",
           "micro_batches": 4, "config": "after", "oracle": "fusion_off", "moe": True, "passed": False,
           "max_rel_diff": 0.5, "expert_min_norm_ratio": 0.5, "expert_max_norm_ratio": 0.5, "harness": 2}
    out = LC.annotate([row, {**row, "layout": "dp1_moe"}, {**row, "expert_min_norm_ratio": 0.9}])
    assert out[0]["upstream"] == LC.UPSTREAM_ORACLE_EP and out[0]["passed"] is False
    assert "upstream" not in out[1] and "upstream" not in out[2]
    assert LC.left_out("ep2_moe") == "fsdp-one-rank-scale" and LC.left_out("dp1_moe") == "moe-te-overwrite"


def test_append_tied_weights_adds_a_run_after_the_existing_ones(tmp_path):
    """A tied-weights run's OUT (its coverage.json: every row, old ones included; its
    coverage_runs.json: that run alone) is added as one more run; earlier runs, records and rows stay."""
    row = {"campaign": "tied-weights", "release": "0.17.1", "layout": "dp1_tied", "strategy": "no_shard", "variant": "",
           "micro_batches": 4, "config": "after", "oracle": "autograd", "max_rel_diff": 1e-3, "passed": True}
    rec = {"release": "0.17.1", "layout": "dp1_tied", "strategy": "no_shard", "micro_batches": 4, "oracles": {}}
    results, run = tmp_path / "results", tmp_path / "run"
    results.mkdir(), run.mkdir()
    (results / "coverage.json").write_text(json.dumps([row]))
    top = {"schema": "s", "gpu": "H200", "model": {"steps": 20}, "bound": {"rule": "r"}, "loss_rule": "l",
           "concurrency": "c", "gemm_patch_sha": {"before": "b", "after": "a"}, "tree_state": "t"}
    (results / "coverage_runs.json").write_text(json.dumps({"tied-weights": {
        **top, "runs": [{"run": 0, "campaign_seconds": 10.0}], "processes": [{"name": "p0", "run": 0}],
        "records": [rec], "campaign_seconds": 10.0}}))
    new_row = {**row, "release": "0.15.3", "max_rel_diff": 2e-3}
    (run / "coverage.json").write_text(json.dumps([row, new_row]))
    (run / "coverage_runs.json").write_text(json.dumps({"tied-weights": {
        **top, "tree_state": "before = X\nafter = Y", "campaign_seconds": 5.0, "processes": [{"name": "p1"}],
        "records": [{**rec, "release": "0.15.3"}]}}))
    assert rc.main(["--append-tied-weights", str(run), "--results", str(results)]) == 0
    runs = json.loads((results / "coverage_runs.json").read_text())["tied-weights"]
    assert [c["run"] for c in runs["runs"]] == [0, 1] and runs["runs"][1]["releases"] == ["0.15.3"]
    assert [p["run"] for p in runs["processes"]] == [0, 1]
    assert [r["release"] for r in runs["records"]] == ["0.15.3", "0.17.1"] and runs["campaign_seconds"] == 15.0
    rows = json.loads((results / "coverage.json").read_text())
    assert sorted(r["release"] for r in rows) == ["0.15.3", "0.17.1"]
    assert "Run 1 (0.15.3: dp1_tied): before = X; after = Y." in (results / "coverage.md").read_text()
