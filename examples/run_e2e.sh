#!/usr/bin/env bash
# The whole issue-4 measurement campaign in one go, on a machine with 1 or 2 GPUs:
#
#     bash examples/run_e2e.sh OUT [NGPU]          # NGPU defaults to every visible GPU (max 2)
#
# Writes exactly four files into OUT: e2e_results.json (everything measured), e2e_logs.txt
# (every log, concatenated), e2e_loss.png and e2e_summary.md (from examples/plot_e2e.py).
# Gradient dumps (~0.5 GB each) go to $SCRATCH (default /tmp/gemm_patch_e2e) and are deleted
# after they are compared unless KEEP_DUMPS=1. Budget: about 1.5 min per GPU count plus
# ~40 s for the two unpatched runs (well under 6 min on a 2-GPU H200 machine).
#
# Environment: PYTHON (default python), STEPS (training steps per configuration, default 20),
# SCRATCH, KEEP_DUMPS. NCCL_NVLS_ENABLE / TORCH_SYMM_MEM_DISABLE_MULTICAST are left as set.
set -u
OUT=${1:?usage: bash examples/run_e2e.sh OUT [NGPU]}
PY=${PYTHON:-python}
NGPU=${2:-$($PY -c 'import torch; print(min(2, torch.cuda.device_count()))')}
STEPS=${STEPS:-20}
SCRATCH=${SCRATCH:-/tmp/gemm_patch_e2e}
HERE=$(cd "$(dirname "$0")" && pwd)
SCRIPT="$HERE/train_gpt_fsdp.py"
mkdir -p "$OUT" "$SCRATCH/parts" "$SCRATCH/dumps" "$SCRATCH/logs"
rm -f "$SCRATCH"/parts/*.json "$SCRATCH"/dumps/*.pt "$SCRATCH"/logs/*
LOG="$OUT/e2e_logs.txt"
: > "$LOG"
STATUS="$SCRATCH/parts/status.jsonl"
: > "$STATUS"
T0=$(date +%s)

note() { echo "== $*" | tee -a "$LOG"; }

# run NAME TIMEOUT CMD...: run, append its log to e2e_logs.txt, record rc and seconds.
run() {
    local name=$1 limit=$2; shift 2
    note "$name ($(date +%T)): $*"
    local start end rc
    start=$(date +%s%N)
    timeout "$limit" "$@" > "$SCRATCH/logs/$name.log" 2>&1 < /dev/null
    rc=$?
    end=$(date +%s%N)
    cat "$SCRATCH/logs/$name.log" >> "$LOG"
    note "$name: rc=$rc after $(( (end - start) / 1000000 )) ms"
    printf '{"name": "%s", "rc": %d, "seconds": %d.%03d, "log": "%s"}\n' "$name" "$rc" \
        $(( (end - start) / 1000000000 )) $(( (end - start) / 1000000 % 1000 )) \
        "$SCRATCH/logs/$name.log" >> "$STATUS"
    return $rc
}

# -- 0. preflight (seconds): the launcher loads gemm_patch, patches the call site, and provides
#       the apex stand-in megatron needs to build ColumnParallelLinear with fusion on.
PREFLIGHT='import sys, torch, transformer_engine, megatron.core.tensor_parallel.layers as L
import gemm_patch
st = {t.name: t.state for t in gemm_patch.status().targets}
print("targets:", st, "apex fused wgrad available:", L._grad_accum_fusion_available)
try:
    import einops
except ImportError:
    print("einops missing: the training script supplies the (dp, tp) mesh itself")
assert st.get("fsdp-wgrad") in ("verified", "unverified"), st
assert L._grad_accum_fusion_available, "no apex stand-in: ColumnParallelLinear would refuse fusion"
print("preflight ok")'
if ! run preflight 120 $PY -m gemm_patch run -- $PY -c "$PREFLIGHT"; then
    note "preflight failed: see above; the campaign needs 'gemm-patch run' and the apex stand-in"
    PREFLIGHT_FAILED=1
fi

# -- 1. unpatched (expected to fail; the traceback is the record)
run unpatched_plain 150 $PY -m torch.distributed.run --standalone --nproc-per-node 1 "$SCRIPT" \
    --steps 2 --out "$SCRATCH/parts/unpatched_plain.json"
run unpatched_launcher_gemm_patch_0 150 env GEMM_PATCH=0 $PY -m gemm_patch run -- \
    $PY -m torch.distributed.run --standalone --nproc-per-node 1 "$SCRIPT" --steps 2 \
    --out "$SCRATCH/parts/unpatched_launcher.json"

# -- 2.-5. patched campaign per GPU count: all configurations in one process per GPU count
for n in $(seq 1 "$NGPU"); do
    [ "${PREFLIGHT_FAILED:-0}" = 1 ] && break
    D="$SCRATCH/dumps/${n}gpu"
    cat > "$SCRATCH/plan_${n}gpu.json" <<EOF
[
 {"name": "patched",            "fusion": "on",  "main_grads_dtype": "fp32", "sharding": "optim_grads_params", "grad_dump": "${D}_on_ogp.pt"},
 {"name": "ref_a",              "fusion": "off", "main_grads_dtype": "fp32", "sharding": "optim_grads_params", "grad_dump": "${D}_off_ogp.pt"},
 {"name": "ref_a_repeat",       "fusion": "off", "main_grads_dtype": "fp32", "sharding": "optim_grads_params", "grad_dump": "${D}_off_ogp_2.pt"},
 {"name": "ref_b",              "fusion": "on",  "main_grads_dtype": "bf16", "sharding": "optim_grads_params"},
 {"name": "grads_on_no_shard",  "fusion": "on",  "main_grads_dtype": "fp32", "sharding": "no_shard", "steps": 1, "grad_dump": "${D}_on_ns.pt"},
 {"name": "grads_off_no_shard", "fusion": "off", "main_grads_dtype": "fp32", "sharding": "no_shard", "steps": 1, "grad_dump": "${D}_off_ns.pt"},
 {"name": "grads_off_no_shard_repeat", "fusion": "off", "main_grads_dtype": "fp32", "sharding": "no_shard", "steps": 1, "grad_dump": "${D}_off_ns_2.pt"},
 {"name": "diag_overwrite_ogp", "fusion": "on",  "main_grads_dtype": "fp32", "sharding": "optim_grads_params", "steps": 1, "wgrad_rule": "overwrite", "grad_dump": "${D}_ow_ogp.pt"},
 {"name": "diag_overwrite_no_shard", "fusion": "on", "main_grads_dtype": "fp32", "sharding": "no_shard", "steps": 1, "wgrad_rule": "overwrite", "grad_dump": "${D}_ow_ns.pt"},
 {"name": "diag_te_fix_ogp",    "fusion": "on",  "main_grads_dtype": "fp32", "sharding": "optim_grads_params", "te_overwrite_fix": true, "grad_dump": "${D}_tefix_ogp.pt"}
]
EOF
    run "campaign_${n}gpu" 270 $PY -m gemm_patch run -- \
        $PY -m torch.distributed.run --standalone --nproc-per-node "$n" "$SCRIPT" \
        --plan "$SCRATCH/plan_${n}gpu.json" --steps "$STEPS" --require-patch \
        --out "$SCRATCH/parts/campaign_${n}gpu.json"
    # Gradient parity (GOT REF NOISE LABEL); diag_* are expected to fail where noted in the notes.
    while read -r got ref noise label; do
        [ -f "$got" ] && [ -f "$ref" ] || { note "compare $label: dump missing"; continue; }
        noise_arg=()
        [ "$noise" != "-" ] && [ -f "$noise" ] && noise_arg=(--noise "$noise")
        run "compare_${n}gpu_${label}" 120 $PY "$HERE/compare_grads.py" "$got" "$ref" ${noise_arg[@]+"${noise_arg[@]}"} \
            --label "${n}gpu ${label}" --json "$SCRATCH/parts/compare_${n}gpu_${label}.json"
    done <<EOF
${D}_on_ogp.pt ${D}_off_ogp.pt ${D}_off_ogp_2.pt parity_optim_grads_params
${D}_on_ns.pt ${D}_off_ns.pt ${D}_off_ns_2.pt parity_no_shard
${D}_off_ogp_2.pt ${D}_off_ogp.pt - noise_optim_grads_params
${D}_off_ns_2.pt ${D}_off_ns.pt - noise_no_shard
${D}_ow_ogp.pt ${D}_off_ogp.pt ${D}_off_ogp_2.pt diag_overwrite_optim_grads_params
${D}_ow_ns.pt ${D}_off_ns.pt ${D}_off_ns_2.pt diag_overwrite_no_shard
${D}_tefix_ogp.pt ${D}_off_ogp.pt ${D}_off_ogp_2.pt diag_te_fix_optim_grads_params
EOF
    [ "${KEEP_DUMPS:-0}" = 1 ] || rm -f "${D}"_*.pt
done

# -- assemble e2e_results.json, then the chart and the table
$PY - "$SCRATCH" "$OUT/e2e_results.json" "$NGPU" "$STEPS" "$(( $(date +%s) - T0 ))" <<'EOF'
import json, re, sys
from pathlib import Path
scratch, out, ngpu, steps, seconds = Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:]
status = [json.loads(l) for l in (scratch / "parts/status.jsonl").read_text().splitlines() if l.strip()]
def tail(path, n=60):
    try:
        return Path(path).read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []
ERROR = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception|Exit))(?::|$)")
def error_line(lines):
    # The worker's exception, not torchrun's ChildFailedError wrapper printed after it.
    errs = [l.strip() for l in lines if ERROR.match(l.strip()) and "ChildFailedError" not in l]
    return errs[-1] if errs else None
def traceback_of(lines):
    starts = [i for i, l in enumerate(lines) if "Traceback (most recent call last)" in l]
    for i in starts:
        for j in range(i + 1, min(len(lines), i + 400)):
            if ERROR.match(lines[j].strip()):
                if "ChildFailedError" in lines[j]:
                    break
                return lines[i:j + 1][-40:]
    return []
result = {"schema": "gemm_patch.e2e/1", "ngpu": int(ngpu), "steps": int(steps),
          "campaign_seconds": int(seconds), "commands": status, "unpatched": {}, "campaigns": {},
          "grad_compare": {}}
for s in status:
    if s["name"].startswith("unpatched") or s["name"] == "preflight":
        lines = tail(s["log"], 100000)
        entry = {"rc": s["rc"], "failed": s["rc"] != 0, "error": error_line(lines),
                 "traceback": traceback_of(lines), "log_tail": lines[-25:]}
        if s["name"] == "preflight":
            result["preflight"] = entry
        else:
            result["unpatched"][s["name"]] = entry
for p in sorted((scratch / "parts").glob("campaign_*gpu.json")):
    result["campaigns"][p.stem.removeprefix("campaign_")] = json.loads(p.read_text())
for p in sorted((scratch / "parts").glob("compare_*.json")):
    data = json.loads(p.read_text())
    data["rows"] = [{k: r[k] for k in ("name", "kind", "rel", "ratio", "noise_rel", "bound", "ok")}
                    for r in data["rows"]]
    result["grad_compare"][p.stem.removeprefix("compare_")] = data
out.write_text(json.dumps(result, indent=1))
print(f"wrote {out}: campaigns {sorted(result['campaigns'])}, compares {len(result['grad_compare'])}")
EOF
run plot 120 $PY "$HERE/plot_e2e.py" "$OUT/e2e_results.json" --png "$OUT/e2e_loss.png" --md "$OUT/e2e_summary.md"
note "done in $(( $(date +%s) - T0 )) s; files: $(ls "$OUT" | tr '\n' ' ')"
