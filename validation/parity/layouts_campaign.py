"""The layouts campaign (``run_coverage.py --campaign layouts``): every fused weight-gradient
write in Megatron-FSDP training, per layout that fits two GPUs, against both oracles.

Layouts (``LAYOUTS``; record names in brackets): ``dp1`` (1 GPU), ``dp2`` [``dp2_<strategy>``],
``tp2_sp`` (TP 2 + sequence parallelism, one DP rank), ``cp2`` (context parallel 2),
``dp1_moe`` (8 experts top-2, grouped GEMM, shared expert, squared ReLU; on 0.19.2 the fused
grouped MLP of TE's op fuser, plus the unfused path as variant ``unfused``), ``ep2_moe`` (the
same, expert parallel 2). Variants (``VARIANTS``) change one setting of a strategy:
``double_buffer`` (fsdp_double_buffer) on dp2 optim_grads_params, ``no_overlap`` (no overlapped
grad reduce / param gather) on dp2 optim_grads.

Processes per (release, layout): ``off`` (fusion off, fp32 main grads: oracle 1; first the
autograd oracle 2 for 4 and 1 micro-batches, autograd_oracle.py, which for TP/CP/EP
gathers the layout's weights and runs a TP = CP = EP = 1 replica), ``off_repeat`` (noise of
both oracles), ``after`` (fusion on under ``python -m gemm_patch run`` with this checkout's
gemm_patch), and for MoE layouts ``before``: the same with the ``moe-te-overwrite`` target left
out (``GEMM_PATCH_DISABLE=<target>`` in the process's environment, so gemm_patch applies without
it from the start; the target shares GEMM_PATCH_TE_OVERWRITE with fsdp-te-overwrite by design,
validation/notes/layouts.md); on ep2_moe ``fsdp-one-rank-scale`` is the one left out. Each process
runs every strategy (and variant) of its layout for one step of 4 and one of 1 micro-batch and
dumps the full reduced gradient after finalize_model_grads, before the optimizer step: gathered
over DP, TP shards concatenated along their partition dimension and experts of every EP rank
under their global index, so every layout's dump has the TP = CP = EP = 1 model's names and
shapes and the comparisons are the same whatever the sharding.

Rows (coverage.json, a list): one per (release, layout, strategy, variant, micro-batches,
config, oracle), ``campaign: "layouts"``; the rule is the tied-weights campaign's
(run_coverage.compare): per parameter
rel <= max(2^-7, 3 x noise). A run that megatron-core (or TE) refuses gives one row with
``unsupported`` = megatron's own message and ``passed: null``; any other failure (a crash of the
script, a missing dump, a process killed at its time limit) gives a row with ``error`` and
``passed: false``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp1": {"gpus": 1, "strategies": ("optim_grads_params", "no_shard")},
    "dp2": {"gpus": 2, "strategies": ("no_shard", "optim", "optim_grads", "optim_grads_params"),
            "variants": {"optim_grads_params": ("double_buffer",), "optim_grads": ("no_overlap",)}},
    "tp2_sp": {"gpus": 2, "tp": 2, "sequence_parallel": "on", "strategies": ("optim_grads_params", "no_shard")},
    "cp2": {"gpus": 2, "cp": 2, "strategies": ("optim_grads_params", "no_shard")},
    # optim / optim_grads: no FSDP units, so no pre-backward unshard resets the fused MLP's flag
    # before TE reads it: where moe-te-overwrite's bug can show (validation/notes/layouts.md)
    "dp1_moe": {"gpus": 1, "moe_experts": 8, "strategies": ("optim_grads_params", "no_shard", "optim_grads", "optim"),
                "variants_0.19": {"optim_grads_params": ("unfused", "recompute")}},
    "ep2_moe": {"gpus": 2, "ep": 2, "moe_experts": 8, "strategies": ("optim_grads_params", "no_shard", "optim"),
                "variants_0.19": {"optim_grads_params": ("unfused", "recompute")}},
}
VARIANTS = {"double_buffer": {"double_buffer": "on"}, "no_overlap": {"overlap": "off"}, "unfused": {"moe_fused": "off"},
            "recompute": {"recompute": "full"}}
# Variants that change the computed products (not only the schedule or the buffers): each has its
# own autograd oracle (``autograd+<variant>``). Compared with the other path's oracle (unfused runs
# vs a fused-MLP oracle, ep2's fused runs vs an unfused replica) bf16 rounding differs between the
# two paths, a few tokens route to other experts: 1-10 % per parameter.
MODEL_VARIANTS = ("unfused",)
# Rows made before the harness fixes (CP loss scale, per-variant MoE oracle) carry no ``harness``
# key; rows made since carry HARNESS.
HARNESS = 2
CAMPAIGN = "layouts"  # the ``campaign`` field of this campaign's rows
TIED = "tied-weights"  # ... and of the tied-embeddings / MTP campaign's (run_coverage.py)
LEFT_OUT = "moe-te-overwrite"  # the target 'before' leaves out (MoE layouts) ...
LEFT_OUT_BY_LAYOUT = {"ep2_moe": "fsdp-one-rank-scale"}  # ... except where another target is the one to show


def left_out(layout: str) -> str:
    """The target a layout's ``before`` process runs without."""
    return LEFT_OUT_BY_LAYOUT.get(layout, LEFT_OUT)

# Failures that are megatron-core's, not gemm-patch's nor the harness's: a row that fails against
# the autograd oracle where one of these matches keeps ``passed: false`` and gains ``upstream``
# (the note), so the table shows it instead of a silent pass. Each: (test(row), note).
UPSTREAM_EP_EXPERT_2X = (
    "upstream (Megatron-FSDP + NCCL): expert gradients 2x with a grad-sharding strategy when the expert "
    "data-parallel group has one rank (EP = DP = 2 on 2 GPUs): gradient_reduce_preprocessing hands "
    "expert_gradient_scaling_factor (1/dp = 0.5) to the reduce-scatter as a PreMulSum op, and NCCL 2.28.9's "
    "reduce_scatter over one rank leaves the data unscaled (bucket probe: ratio 1.0 with div fusion, 0.5 "
    "without; validation/probes/premul_one_rank.py: 2.0 for 0.5 x 2.0, all_reduce correct); the fusion-off run "
    "shows it equally; gemm-patch's fsdp-one-rank-scale applies the factor once per step instead")
UPSTREAM_ORACLE_EP = (
    "oracle (fusion_off, no gemm-patch) carries the upstream one-rank reduce-scatter bug above: its expert "
    "gradients are 2x autograd; after (fsdp-one-rank-scale on) is compared with autograd instead")
_EP_SHARDED = ("optim", "optim_grads", "optim_grads_params")


def upstream_note(row: dict[str, Any]) -> str | None:
    """The known upstream cause of a failing row, or None."""
    if row.get("passed") is not False or row.get("layout") != "ep2_moe" or row.get("strategy") not in _EP_SHARDED:
        return None
    lo, hi = row.get("expert_min_norm_ratio"), row.get("expert_max_norm_ratio")
    if row.get("oracle") == "autograd" and row.get("config") in ("off", "off_repeat", "before") \
            and hi is not None and 1.9 <= hi <= 2.1:
        return UPSTREAM_EP_EXPERT_2X
    if row.get("oracle") == "fusion_off" and row.get("config") == "after" and lo is not None and 0.45 <= lo <= 0.55:
        return UPSTREAM_ORACLE_EP
    return None


HARNESS_NOTES = {
    "cp_loss": "harness (fixed since): the CP loss was each rank's local mean, which megatron's schedule "
               "multiplies by cp (schedules.py:272 in 0.17.1, :340 in 0.19.2) before Megatron-FSDP divides "
               "by dp x cp: every gradient 2x (train_gpt_fsdp.py loss_func now divides by cp); rerun pending",
    "moe_path": "harness (fixed since): the autograd oracle ran the other MoE path (0.19's fused grouped MLP "
                "vs unfused); bf16 rounding differs, a few tokens route to other experts, 1-10 % per "
                "parameter (each model variant has its own oracle now, the replica keeps the run's path); "
                "rerun pending",
}


def harness_note(row: dict[str, Any]) -> str | None:
    """Failures of rows made before the harness fixes (no ``harness`` key) that the harness caused."""
    if row.get("campaign") != CAMPAIGN or row.get("harness") or row.get("passed") is not False \
            or row.get("oracle") != "autograd":
        return None
    notes = []
    if row.get("layout") == "cp2":
        notes.append(HARNESS_NOTES["cp_loss"])
    if row.get("moe") and moe_fused(row["release"]) == "on" and (
            row.get("variant") == "unfused" or (row.get("layout") == "ep2_moe" and not row.get("variant"))):
        notes.append(HARNESS_NOTES["moe_path"])
    return "; ".join(notes) or None


def annotate(rows: list[dict]) -> list[dict]:
    """Layouts-campaign rows with ``upstream`` / ``harness_issue`` notes where a known cause matches."""
    out = []
    for r in rows:
        if r.get("campaign") == CAMPAIGN:
            r = {k: v for k, v in r.items() if k not in ("upstream", "harness_issue")}
            up, hn = upstream_note(r), harness_note(r)
            if up:
                r["upstream"] = up
            if hn:
                r["harness_issue"] = hn
        out.append(r)
    return out
SMOKE_LAYOUTS = ("tp2_sp", "cp2", "dp1_moe", "ep2_moe")
ROW_KEY = ("campaign", "release", "layout", "strategy", "variant", "micro_batches", "config", "oracle")


def moe_fused(rel: str) -> str:
    """The fused grouped MLP exists from megatron-core 0.19 (TEGroupedMLP._ensure_main_grad)."""
    major, minor = (int(x) for x in rel.split(".")[:2])
    return "on" if (major, minor) >= (0, 19) else "off"


def record_layout(layout: str, strategy: str) -> str:
    return f"dp2_{strategy}" if layout == "dp2" else layout


def configs_for(layout: str, configs: list[str]) -> list[str]:
    moe = bool(LAYOUTS[layout].get("moe_experts"))
    return [c for c in configs if c != "before" or moe]


def strategies_for(layout: str, rel: str, smoke: bool = False) -> list[tuple[str, str]]:
    """(strategy, variant) pairs of a layout on a release; '' is no variant."""
    lay = LAYOUTS[layout]
    if smoke:
        return [("optim_grads_params", "")]
    variants = dict(lay.get("variants", {}))
    if moe_fused(rel) == "on":
        variants.update(lay.get("variants_0.19", {}))
    out = []
    for s in lay["strategies"]:
        out.append((s, ""))
        out.extend((s, v) for v in variants.get(s, ()))
    return out


def what(strategy: str, variant: str) -> str:
    return f"{strategy}+{variant}" if variant else strategy


def oracle_what(variant: str) -> str:
    """The autograd oracle's dump name for runs of this variant."""
    return f"autograd+{variant}" if variant in MODEL_VARIANTS else "autograd"


def plan_for(layout: str, rel: str, config: str, model: dict[str, Any], dump, smoke: bool = False) -> list[dict]:
    """The --plan of one process: autograd oracles first (off, off_repeat), then every strategy
    and variant for 4 and 1 micro-batches (1 only in smoke mode), one step each."""
    lay = LAYOUTS[layout]
    shape = {"tp": lay.get("tp", 1), "cp": lay.get("cp", 1), "ep": lay.get("ep", 1),
             "sequence_parallel": lay.get("sequence_parallel", "off"), "moe_experts": lay.get("moe_experts", 0),
             "moe_fused": moe_fused(rel) if lay.get("moe_experts") else "none", "tied": "off", "mtp_layers": 0}
    counts = (1,) if smoke else (4, 1)
    fusion = "off" if config.startswith("off") else "on"
    plan = []
    if fusion == "off":
        for v in ("", *sorted({v for _, v in strategies_for(layout, rel, smoke) if v in MODEL_VARIANTS})):
            for m in counts:
                plan.append({**model, **shape, **VARIANTS.get(v, {}), "name": f"{config}.{oracle_what(v)}.m{m}",
                             "mode": "autograd", "fusion": "off", "micro_batches": m, "steps": 1,
                             "grad_dump": str(dump(config, oracle_what(v), m))})
    for s, v in strategies_for(layout, rel, smoke):
        for m in counts:
            plan.append({**model, **shape, **VARIANTS.get(v, {}), "name": f"{config}.{what(s, v)}.m{m}",
                         "mode": "train", "fusion": fusion, "sharding": s, "micro_batches": m, "steps": 1,
                         "grad_dump": str(dump(config, what(s, v), m))})
    return plan


def expert_ratios(cmp: dict[str, Any]) -> dict[str, Any]:
    k = (cmp.get("by_kind") or {}).get("expert")
    return {"expert_min_norm_ratio": k["min_ratio"], "expert_max_norm_ratio": k["max_ratio"]} if k else {}


def run_failures(parts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{run name: its record} for runs that raised (``unsupported`` or ``error``)."""
    out = {}
    for part in parts.values():
        for r in (part or {}).get("runs", []):
            if r.get("unsupported") or r.get("error"):
                out[r["name"]] = r
    return out


def assemble(procs: list[dict], parts: dict[str, Any], dump, load, compare, smoke: bool = False):
    """Rows for every (release, layout, strategy, variant, micro-batches) of the processes.
    ``dump(rel, layout, config, what, m)`` -> path, ``load(path)`` -> {name: tensor} or None,
    ``compare(got, ref, noise_pairs)`` -> run_coverage.compare's dict. Returns (rows, details)."""
    rows, details = [], {}
    groups = sorted({(p["release"], p["layout"]) for p in procs}, key=lambda g: (g[0], list(LAYOUTS).index(g[1])))
    for rel, layout in groups:
        lay = LAYOUTS[layout]
        mine = {p["config"]: p for p in procs if p["release"] == rel and p["layout"] == layout}
        failures = run_failures({c: parts.get(p["name"]) for c, p in mine.items()})
        moe_paths = sorted({x for c, p in mine.items() for r in (parts.get(p["name"]) or {}).get("runs", [])
                            for x in (r.get("moe_path") or [])})
        for s, v in strategies_for(layout, rel, smoke):
            for m in ((1,) if smoke else (4, 1)):
                base = {"campaign": CAMPAIGN, "layout": record_layout(layout, s), "release": rel, "strategy": s,
                        "variant": v,
                        "micro_batches": m, "moe": bool(lay.get("moe_experts")),
                        "tp": lay.get("tp", 1), "cp": lay.get("cp", 1), "ep": lay.get("ep", 1),
                        "gpus": lay["gpus"]}
                if base["moe"]:
                    base["moe_path"] = moe_paths
                refused = [(c, failures[n]) for c in mine
                           for n in (f"{c}.{what(s, v)}.m{m}", f"{c}.{oracle_what(v)}.m{m}") if n in failures]
                unsupported = [(c, f) for c, f in refused if f.get("unsupported")]
                if unsupported:  # megatron refuses the layout: one row, megatron's own message
                    c, f = unsupported[0]
                    rows.append({**base, "config": c, "oracle": None, "unsupported": f["unsupported"],
                                 "raised_in": f.get("raised_in"), "passed": None})
                    continue

                w = what(s, v)

                def d(config, w=w, m=m, rel=rel, layout=layout):
                    return load(dump(rel, layout, config, w, m))

                off, off2 = d("off"), d("off_repeat")
                ag, ag2 = d("off", oracle_what(v)), d("off_repeat", oracle_what(v))
                for oracle, ref, noises, gots in (
                        ("fusion_off", off, [(off2, off)], ("after", "before", "off_repeat")),
                        ("autograd", ag, [(ag2, ag), (off2, off)], ("after", "before", "off", "off_repeat"))):
                    for g in gots:
                        if g not in mine:
                            continue
                        row = {**base, "config": g, "oracle": oracle, "harness": HARNESS}
                        got = d(g)
                        if ref is None or got is None:
                            why = [f"{c}: {f.get('error')}" for c, f in refused] or [
                                f"dump missing: {'reference' if ref is None else g} "
                                f"(process rc {mine.get('off' if ref is None else g, {}).get('rc')}, "
                                f"{mine.get('off' if ref is None else g, {}).get('skipped') or 'ran'})"]
                            rows.append({**row, "error": "; ".join(why), "passed": False})
                            continue
                        cmp = compare(got, ref, [(a, b) for a, b in noises if a is not None and b is not None])
                        details[f"{rel}.{layout}.{what(s, v)}.m{m}.{g}_vs_{oracle}"] = cmp
                        rows.append({**row, **{k: cmp[k] for k in ("params", "max_rel_diff", "worst_param",
                                                                   "min_norm_ratio", "max_norm_ratio", "passed")},
                                     **expert_ratios(cmp)})
    return annotate(rows), details


def row_key(r: dict[str, Any]) -> tuple:
    return tuple(r.get(k) if k != "variant" else (r.get(k) or "") for k in ROW_KEY)


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """Old rows with new ones replacing those of the same key (campaign, release, layout, strategy,
    variant, micro-batches, config, oracle); a group (campaign, release, layout) that the new rows
    cover drops its old 'unsupported'/'error' rows, so a later success is not shadowed by an
    earlier failure. Sorted for diffs: campaign, release, layout, strategy, variant, -M, config, oracle."""
    covered = {(r["campaign"], r["release"], r["layout"], r["strategy"], r.get("variant") or "") for r in new}
    keep = {}
    for r in old:
        group = (r.get("campaign"), r["release"], r["layout"], r["strategy"], r.get("variant") or "")
        if group in covered and (r.get("unsupported") or r.get("error")):
            continue
        keep[row_key(r)] = r
    for r in new:
        keep[row_key(r)] = r
    return sorted(keep.values(), key=lambda r: tuple(str(x) if i != 5 else -(x or 0)
                                                     for i, x in enumerate(row_key(r))))


def load_rows(path: Path) -> list[dict]:
    """coverage.json as a list (a dict-form file, the tied-weights campaign's own format, gives its
    'rows' tagged with its campaign)."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if isinstance(data, list):
        return data
    return [{"campaign": data.get("campaign", TIED), "variant": "", **r} for r in data.get("rows", [])]


def dumps_rows(rows: list[dict]) -> str:
    """One JSON object per line: diffable."""
    return "[\n" + ",\n".join(json.dumps(r, separators=(",", ":")) for r in rows) + "\n]\n"


def _cell(rows: list[dict], config: str, oracle: str, expert: bool = False) -> str:
    xs = [r for r in rows if r.get("config") == config and r.get("oracle") == oracle]
    if not xs:
        return "-"
    bad = [r for r in xs if r.get("error") or r.get("max_rel_diff") is None]
    ok = [r for r in xs if r not in bad]
    if not ok:
        return f"error ({len(bad)})"
    passed = sum(bool(r["passed"]) for r in ok)
    up = sum(bool(r.get("upstream")) for r in ok if not r["passed"])
    hn = sum(bool(r.get("harness_issue")) and not r.get("upstream") for r in ok if not r["passed"])
    notes = "".join(f", {n} {w}" for n, w in ((up, "upstream"), (hn, "harness")) if n)
    worst = max(r["max_rel_diff"] for r in ok)
    key = ("expert_min_norm_ratio", "expert_max_norm_ratio") if expert else ("min_norm_ratio", "max_norm_ratio")
    lo = min((r.get(key[0]) for r in ok if r.get(key[0]) is not None), default=None)
    hi = max((r.get(key[1]) for r in ok if r.get(key[1]) is not None), default=None)
    ratio = f", {'experts ' if expert else ''}ratio {lo:.3f}-{hi:.3f}" if lo is not None else ""
    return f"{worst:.1e}{ratio}, {passed}/{len(xs)} pass{notes}" + (f", {len(bad)} error" if bad else "")


def markdown(rows: list[dict]) -> str:
    """The layouts campaign's table: one row per (release, layout), over its strategies, variants and both
    micro-batch counts."""
    mine = [r for r in rows if r.get("campaign") == CAMPAIGN]
    order = {record_layout(lay, s): i for i, (lay, spec) in enumerate(LAYOUTS.items()) for s in spec["strategies"]}
    groups: dict[tuple, list] = {}
    for r in sorted(mine, key=lambda r: (r["release"], order.get(r["layout"], 99))):
        groups.setdefault((r["release"], r["layout"]), []).append(r)
    lines = ["## Every layout on two H200s (megatron-core 0.17.1 and 0.19.2, TE 2.20.2)", "",
             "Rule: per parameter rel = ||g - g_ref|| / ||g_ref|| <= max(2^-7, 3 x noise), the full reduced "
             "gradient of every parameter (gathered over DP, TP and EP) after one step of 4 and of 1 "
             "micro-batch. Cells: worst rel diff, norm ratio range, comparisons passing. `before` = gemm-patch "
             f"without `{LEFT_OUT}` (MoE layouts; expert weights' ratio), without "
             f"`{LEFT_OUT_BY_LAYOUT['ep2_moe']}` on ep2_moe.", "",
             "| release | layout | strategies | MoE path | after vs fusion_off | after vs autograd "
             "| fusion_off vs autograd | before vs fusion_off (experts) | unsupported |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (rel, layout), rs in groups.items():
        strategies = sorted({what(r["strategy"], r.get("variant") or "") for r in rs})
        unsup = sorted({r["unsupported"] for r in rs if r.get("unsupported")})
        path = ", ".join(next((r.get("moe_path") for r in rs if r.get("moe_path")), [])) or "-"
        lines.append(f"| {rel} | {layout} | {', '.join(strategies)} | {path} | {_cell(rs, 'after', 'fusion_off')} | "
                     f"{_cell(rs, 'after', 'autograd')} | {_cell(rs, 'off', 'autograd')} | "
                     f"{_cell(rs, 'before', 'fusion_off', expert=True)} | {'; '.join(unsup)[:300] or '-'} |")
    befores = {}
    for r in mine:
        if r.get("config") == "before" and r.get("oracle") == "fusion_off" and r.get("expert_min_norm_ratio"):
            k = (r["release"], r["layout"], what(r["strategy"], r.get("variant") or ""))
            lo, hi = befores.get(k, (9.0, 0.0))
            befores[k] = (min(lo, r["expert_min_norm_ratio"]), max(hi, r["expert_max_norm_ratio"]))
    if befores:
        lines += ["", "`before` (without the layout's left-out target) vs fusion_off, expert weights' norm ratio "
                  "per strategy: "
                  + "; ".join(f"{a} {b} {c} {lo:.3f}-{hi:.3f}" for (a, b, c), (lo, hi) in sorted(befores.items()))
                  + ". Under optim_grads_params the TransformerLayer is a Megatron-FSDP unit whose pre-backward "
                    "unshard (fsdp-te-overwrite's reset) runs after every forward of the layer, the recomputed one "
                    "of `+recompute` included (that forward registers it), and before the experts' backward, where "
                    "TE's op fuser reads the flag; no_shard never sets it. Strategies without units (optim, "
                    "optim_grads) have no pre-backward unshard: there the source predicts the MoE target's bug "
                    "(not run; validation/notes/layouts.md)."]
    failing = sorted({(r["release"], r["layout"], r["config"], r["oracle"], r.get("worst_param") or r.get("error"),
                       "upstream" if r.get("upstream") else "harness" if r.get("harness_issue") else "open")
                      for r in mine if r.get("passed") is False and r.get("config") != "before"})
    if failing:
        lines += ["", "Failing (worst parameter; cause): " + "; ".join(
            f"{a} {b} {c} vs {d}: `{e}` ({f})" for a, b, c, d, e, f in failing[:24]) + "."]
    notes = sorted({(("upstream", r["upstream"]) if r.get("upstream") else ("harness", r["harness_issue"]))
                    for r in mine if r.get("passed") is False and (r.get("upstream") or r.get("harness_issue"))})
    if notes:
        lines += ["", "Known causes of failing rows (the rows keep `passed: false`):", ""]
        lines += [f"- {t}" for _, t in notes]
    return "\n".join(lines) + "\n"
