#!/usr/bin/env bash
# The end-to-end measurement campaign (validation/notes/e2e.md) in one go, on a machine with 1 or 2 GPUs:
#
#     bash validation/e2e/run_e2e.sh OUT [NGPU]          # NGPU defaults to every visible GPU (max 2)
#
# Writes exactly four files into OUT: e2e_results.json (everything measured), e2e_logs.txt
# (every log, concatenated), e2e_loss.png and e2e_summary.md (from validation/e2e/plot_e2e.py).
# Gradient dumps (~0.5 GB each) go to $SCRATCH (default /tmp/gemm_patch_e2e) and are deleted
# after they are compared unless KEEP_DUMPS=1.
#
# Every timed configuration runs in its own torchrun process (its peak memory is its own);
# 1-step gradient-dump configurations ride along after it in the same process and report their
# peak above the memory allocated before their model was built. On 2 GPUs the 1-GPU processes
# run two at a time, one per GPU (pairs with the same step count: patched || (a), (a') || (b)).
#
# Budget on a 2-GPU H200 machine: ~20 s preflight + unpatched (concurrent), 3 x ~30 s for the
# 1-GPU processes, 4 x ~30 s for the 2-GPU ones, ~10 s per gradient comparison batch: about
# 4 to 4.5 minutes. No training process starts after DEADLINE seconds (default 400), and each
# is killed after PROC_LIMIT seconds (default 100), so the JSON, table and plot are written
# well inside a 10-minute cap even when something hangs.
#
# Environment: PYTHON (default python), STEPS (training steps per timed configuration, default
# 16), SCRATCH, KEEP_DUMPS, DEADLINE, PROC_LIMIT, DIAG_2GPU=1 (also run the diagnostic process
# on 2 GPUs, ~30 s more). NCCL_NVLS_ENABLE / TORCH_SYMM_MEM_DISABLE_MULTICAST are left as set.
# GEMM_PATCH_TE_OVERWRITE is removed from every process's environment except the diagnostic
# one, which sets it to 0: "patched" is `gemm-patch run` with all defaults.
set -u
OUT=${1:?usage: bash validation/e2e/run_e2e.sh OUT [NGPU]}
PY=${PYTHON:-python}
NGPU=${2:-$($PY -c 'import torch; print(min(2, torch.cuda.device_count()))')}
STEPS=${STEPS:-16}
SCRATCH=${SCRATCH:-/tmp/gemm_patch_e2e}
DEADLINE=${DEADLINE:-400}
PROC_LIMIT=${PROC_LIMIT:-100}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
# The training script and the gradient comparison run as modules of this checkout, last on the path
# (gemm_patch itself comes from the caller's PYTHONPATH where it is there).
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT"
MODULE=validation.parity.train_gpt_fsdp
mkdir -p "$OUT" "$SCRATCH/parts" "$SCRATCH/dumps" "$SCRATCH/logs" "$SCRATCH/plans"
rm -f "$SCRATCH"/parts/*.json "$SCRATCH"/dumps/*.pt "$SCRATCH"/logs/* "$SCRATCH"/plans/*
LOG="$OUT/e2e_logs.txt"
: > "$LOG"
STATUS="$SCRATCH/parts/status.jsonl"
: > "$STATUS"
T0=$(date +%s)

# Physical ids of the GPUs to use, respecting a CUDA_VISIBLE_DEVICES set by the caller.
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a GPU_IDS <<< "$CUDA_VISIBLE_DEVICES"
else
    GPU_IDS=(0 1)
fi
GPU_A=${GPU_IDS[0]:-0}
GPU_B=${GPU_IDS[1]:-$GPU_A}
GPUS_ALL=$GPU_A
[ "$NGPU" -ge 2 ] && GPUS_ALL="$GPU_A,$GPU_B"

note() { echo "== $*" | tee -a "$LOG"; }
elapsed() { echo $(( $(date +%s) - T0 )); }

# run NAME TIMEOUT CMD...: run, append its log to e2e_logs.txt, record rc and seconds.
run() {
    local name=$1 limit=$2; shift 2
    note "$name ($(date +%T), t=$(elapsed)s): $*"
    local start end rc
    start=$(date +%s%N)
    timeout -k 10 "$limit" "$@" > "$SCRATCH/logs/$name.log" 2>&1 < /dev/null
    rc=$?
    end=$(date +%s%N)
    { echo "---- log of $name ----"; cat "$SCRATCH/logs/$name.log"; } >> "$LOG"
    note "$name: rc=$rc after $(( (end - start) / 1000000 )) ms"
    printf '{"name": "%s", "rc": %d, "seconds": %d.%03d, "start_s": %d, "log": "%s"}\n' "$name" "$rc" \
        $(( (end - start) / 1000000000 )) $(( (end - start) / 1000000 % 1000 )) \
        $(( start / 1000000000 - T0 )) "$SCRATCH/logs/$name.log" >> "$STATUS"
    return $rc
}

# train NAME NPROC GPUS PLAN [VAR=VALUE...]: one torchrun process under `gemm-patch run` running
# the plan's configurations; VAR=VALUE go into its environment (after GEMM_PATCH_TE_OVERWRITE
# is removed, so the defaults are gemm_patch's own).
train() {
    local name=$1 nproc=$2 gpus=$3 plan=$4; shift 4
    if [ "$(elapsed)" -gt "$DEADLINE" ]; then
        note "$name: skipped, $(elapsed) s > DEADLINE=$DEADLINE s"
        printf '{"name": "%s", "rc": -1, "seconds": 0, "skipped": "deadline", "log": ""}\n' "$name" >> "$STATUS"
        return 0
    fi
    run "$name" "$PROC_LIMIT" env -u GEMM_PATCH_TE_OVERWRITE CUDA_VISIBLE_DEVICES="$gpus" "$@" \
        $PY -m gemm_patch run -- $PY -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
        -m "$MODULE" --plan "$plan" --steps "$STEPS" --require-patch --out "$SCRATCH/parts/train_${name}.json"
}

# pair "NAME PLAN [VAR=VALUE...]" "NAME PLAN [VAR=VALUE...]": two 1-GPU processes, one per GPU
# at the same time when there are 2 GPUs, else one after the other.
pair() {
    local -a a b
    read -r -a a <<< "$1"
    read -r -a b <<< "${2:-}"
    if [ "$NGPU" -ge 2 ] && [ ${#b[@]} -gt 0 ]; then
        train "${a[0]}" 1 "$GPU_A" "${a[@]:1}" &
        train "${b[0]}" 1 "$GPU_B" "${b[@]:1}" &
        wait
    else
        train "${a[0]}" 1 "$GPU_A" "${a[@]:1}"
        [ ${#b[@]} -gt 0 ] && train "${b[0]}" 1 "$GPU_A" "${b[@]:1}"
    fi
    return 0
}

# plan FILE NAME:SPEC...: write a --plan file; SPEC is the JSON body of one configuration.
plan() {
    local file=$1; shift
    { echo "["; local sep=""; for entry in "$@"; do echo "$sep $entry"; sep=","; done; echo "]"; } > "$file"
}

# -- 0. preflight and the two unpatched runs, all at once (~20 s).
# The preflight checks that the launcher loads gemm_patch, patches the megatron call site
# (fsdp-wgrad), provides the apex stand-in, and reports every target's state before and after
# Megatron-FSDP is imported (fsdp-te-overwrite is "pending" until then; only fsdp-wgrad and the
# apex stand-in are required, a missing TE fix is reported by the runs themselves).
PREFLIGHT='import os, sys, torch, transformer_engine, megatron.core.tensor_parallel.layers as L
import gemm_patch
def states():
    return [(t.name, t.module, t.state, t.reason) for t in gemm_patch.status().targets]
print("GEMM_PATCH_TE_OVERWRITE =", repr(os.environ.get("GEMM_PATCH_TE_OVERWRITE")))
print("targets before the FSDP import:", [(n, s) for n, _, s, _ in states()])
print("apex fused wgrad available:", L._grad_accum_fusion_available)
try:
    import einops
except ImportError:
    print("einops missing: the training script supplies the (dp, tp) mesh itself")
import megatron.core.distributed.fsdp.mcore_fsdp_adapter  # imports Megatron-FSDP
for name, module, state, reason in states():
    print(f"target {name:<20} {state:<12} {module}: {reason}")
st = {n: s for n, _, s, _ in states()}
assert st.get("fsdp-wgrad") in ("verified", "unverified"), st
assert L._grad_accum_fusion_available, "no apex stand-in: ColumnParallelLinear would refuse fusion"
te = [s for n, _, s, _ in states() if n.startswith("fsdp-te-overwrite")]
if not te or any(s not in ("verified", "unverified") for s in te):
    print("WARNING: fsdp-te-overwrite is not patched after the FSDP import:", te or "no such target",
          "- the patched 1-GPU optim_grads_params runs will show the TE-layer bug")
print("preflight ok")'
# Unpatched: the smallest model that reaches the output layer's fused wgrad; it fails in the
# first forward/backward (the error is the record), so its size does not matter.
UNPATCHED_ARGS=(--steps 1 --layers 1 --hidden 256 --seq 128 --vocab 1024 --micro-batches 1 --micro-batch-size 1)
run preflight 120 env -u GEMM_PATCH_TE_OVERWRITE $PY -m gemm_patch run -- $PY -c "$PREFLIGHT" &
if [ "$NGPU" -ge 2 ]; then
    run unpatched_plain 120 env CUDA_VISIBLE_DEVICES="$GPU_A" $PY -m torch.distributed.run --standalone \
        --nproc-per-node 1 -m "$MODULE" "${UNPATCHED_ARGS[@]}" --out "$SCRATCH/parts/unpatched_plain.json" &
    run unpatched_launcher_gemm_patch_0 120 env CUDA_VISIBLE_DEVICES="$GPU_B" GEMM_PATCH=0 \
        $PY -m gemm_patch run -- $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m "$MODULE" \
        "${UNPATCHED_ARGS[@]}" --out "$SCRATCH/parts/unpatched_launcher.json" &
    wait
else
    wait
    run unpatched_plain 120 env CUDA_VISIBLE_DEVICES="$GPU_A" $PY -m torch.distributed.run --standalone \
        --nproc-per-node 1 -m "$MODULE" "${UNPATCHED_ARGS[@]}" --out "$SCRATCH/parts/unpatched_plain.json"
    run unpatched_launcher_gemm_patch_0 120 env CUDA_VISIBLE_DEVICES="$GPU_A" GEMM_PATCH=0 \
        $PY -m gemm_patch run -- $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m "$MODULE" \
        "${UNPATCHED_ARGS[@]}" --out "$SCRATCH/parts/unpatched_launcher.json"
fi
if ! grep -q "^preflight ok" "$SCRATCH/logs/preflight.log"; then
    note "preflight failed: see above; the campaign needs 'gemm-patch run' and the apex stand-in"
    PREFLIGHT_FAILED=1
fi

# -- 1. the patched campaign per GPU count
OGP='"main_grads_dtype": "fp32", "sharding": "optim_grads_params"'
NS='"main_grads_dtype": "fp32", "sharding": "no_shard", "steps": 1'
for n in $(seq 1 "$NGPU"); do
    [ "${PREFLIGHT_FAILED:-0}" = 1 ] && break
    D="$SCRATCH/dumps/${n}gpu"
    P="$SCRATCH/plans/${n}gpu"
    plan "${P}_patched.json" \
        "{\"name\": \"patched\", \"fusion\": \"on\", $OGP, \"grad_dump\": \"${D}_on_ogp.pt\"}" \
        "{\"name\": \"grads_on_no_shard\", \"fusion\": \"on\", $NS, \"grad_dump\": \"${D}_on_ns.pt\"}"
    plan "${P}_ref_a.json" \
        "{\"name\": \"ref_a\", \"fusion\": \"off\", $OGP, \"grad_dump\": \"${D}_off_ogp.pt\"}" \
        "{\"name\": \"grads_off_no_shard\", \"fusion\": \"off\", $NS, \"grad_dump\": \"${D}_off_ns.pt\"}"
    plan "${P}_ref_a_repeat.json" \
        "{\"name\": \"ref_a_repeat\", \"fusion\": \"off\", $OGP, \"grad_dump\": \"${D}_off_ogp_2.pt\"}" \
        "{\"name\": \"grads_off_no_shard_repeat\", \"fusion\": \"off\", $NS, \"grad_dump\": \"${D}_off_ns_2.pt\"}"
    plan "${P}_ref_b.json" \
        "{\"name\": \"ref_b\", \"fusion\": \"on\", \"main_grads_dtype\": \"bf16\", \"sharding\": \"optim_grads_params\"}"
    # Diagnostic process, TE fix off (GEMM_PATCH_TE_OVERWRITE=0): the patched run without it
    # (TE layers only), then the pre-fix state of both call sites (output layer forced to
    # overwrite through the wgrad rule, TE fix off), 1 step each.
    plan "${P}_diag.json" \
        "{\"name\": \"patched_no_te_fix\", \"fusion\": \"on\", $OGP, \"grad_dump\": \"${D}_note_ogp.pt\"}" \
        "{\"name\": \"diag_before_ogp\", \"fusion\": \"on\", $OGP, \"steps\": 1, \"wgrad_rule\": \"overwrite\", \"grad_dump\": \"${D}_ow_ogp.pt\"}" \
        "{\"name\": \"diag_before_no_shard\", \"fusion\": \"on\", $NS, \"wgrad_rule\": \"overwrite\", \"grad_dump\": \"${D}_ow_ns.pt\"}"
    if [ "$n" = 1 ]; then
        pair "1gpu_patched ${P}_patched.json" "1gpu_ref_a ${P}_ref_a.json"
        pair "1gpu_ref_a_repeat ${P}_ref_a_repeat.json" "1gpu_ref_b ${P}_ref_b.json"
        pair "1gpu_diag ${P}_diag.json GEMM_PATCH_TE_OVERWRITE=0"
    else
        for cfg in patched ref_a ref_a_repeat ref_b; do
            train "${n}gpu_${cfg}" "$n" "$GPUS_ALL" "${P}_${cfg}.json"
        done
        [ "${DIAG_2GPU:-0}" = 1 ] && train "${n}gpu_diag" "$n" "$GPUS_ALL" "${P}_diag.json" GEMM_PATCH_TE_OVERWRITE=0
    fi
    # Gradient parity, one process for all comparisons of this GPU count (label GOT REF NOISE);
    # the diag_* rows are expected to fail where the notes say so.
    cat > "${P}_compare.txt" <<EOF
parity_optim_grads_params ${D}_on_ogp.pt ${D}_off_ogp.pt ${D}_off_ogp_2.pt
parity_no_shard ${D}_on_ns.pt ${D}_off_ns.pt ${D}_off_ns_2.pt
noise_optim_grads_params ${D}_off_ogp_2.pt ${D}_off_ogp.pt -
noise_no_shard ${D}_off_ns_2.pt ${D}_off_ns.pt -
diag_no_te_fix_optim_grads_params ${D}_note_ogp.pt ${D}_off_ogp.pt ${D}_off_ogp_2.pt
diag_before_optim_grads_params ${D}_ow_ogp.pt ${D}_off_ogp.pt ${D}_off_ogp_2.pt
diag_before_no_shard ${D}_ow_ns.pt ${D}_off_ns.pt ${D}_off_ns_2.pt
EOF
    run "compare_${n}gpu" 120 $PY -m validation.parity.compare_grads --batch "${P}_compare.txt" \
        --out-dir "$SCRATCH/parts" --prefix "${n}gpu_" --quiet
    [ "${KEEP_DUMPS:-0}" = 1 ] || rm -f "${D}"_*.pt
done

# -- 2. assemble e2e_results.json, then the chart and the table
$PY - "$SCRATCH" "$OUT/e2e_results.json" "$NGPU" "$STEPS" "$(elapsed)" "$HERE" <<'EOF'
import json, re, sys
from pathlib import Path
scratch, out, ngpu, steps, seconds, here = Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:]
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
result = {"schema": "gemm_patch.e2e/2", "ngpu": int(ngpu), "steps": int(steps),
          "campaign_seconds": int(seconds), "commands": status, "unpatched": {}, "campaigns": {},
          "grad_compare": {},
          "memory_method": "process: every timed configuration runs first in its own torchrun process, so "
                           "its peak_mem_bytes is its own; 1-step gradient-dump configurations that follow "
                           "it in the same process report peak_mem_above_baseline_bytes (peak minus the "
                           "memory allocated right before their model was built)",
          "concurrency": "1-GPU processes run two at a time on separate GPUs when 2 are present "
                         "(patched || ref_a, ref_a_repeat || ref_b); 2-GPU processes run one at a time"}
for s in status:
    if s["name"].startswith("unpatched") or s["name"] == "preflight":
        lines = tail(s["log"], 100000)
        entry = {"rc": s["rc"], "failed": s["rc"] != 0, "error": error_line(lines),
                 "traceback": traceback_of(lines), "log_tail": lines[-25:]}
        if s["name"] == "preflight":
            entry["targets"] = [l for l in lines if l.startswith(("target ", "targets ", "WARNING"))]
            result["preflight"] = entry
        else:
            result["unpatched"][s["name"]] = entry
starts = {s["name"]: s.get("start_s") for s in status}
for p in sorted((scratch / "parts").glob("train_*.json")):
    process = p.stem.removeprefix("train_")
    part = json.loads(p.read_text())
    key = f"{part['world_size']}gpu"
    campaign = result["campaigns"].setdefault(key, {k: v for k, v in part.items() if k not in ("runs", "argv")})
    campaign.setdefault("processes", {})[process] = {
        k: part.get(k) for k in ("argv", "env", "gemm_patch", "gemm_patch_after_wrap", "einops_stand_in")}
    campaign.setdefault("runs", [])
    for i, run in enumerate(part["runs"]):
        run["process"], run["position_in_process"], run["process_start_s"] = process, i, starts.get(process)
        campaign["runs"].append(run)
for p in sorted((scratch / "parts").glob("compare_*.json")):
    data = json.loads(p.read_text())
    data["rows"] = [{k: r[k] for k in ("name", "kind", "rel", "ratio", "noise_rel", "bound", "ok")}
                    for r in data.get("rows", [])]
    result["grad_compare"][p.stem.removeprefix("compare_")] = data
try:  # the loss-parity verdicts, as the table states them
    from validation.e2e import plot_e2e  # run from the repository root
    result["loss_parity"] = plot_e2e.all_parity(result)
except Exception as exc:
    result["loss_parity"] = {"error": f"{type(exc).__name__}: {exc}"}
out.write_text(json.dumps(result, indent=1))
print(f"wrote {out}: campaigns {sorted(result['campaigns'])}, "
      f"runs {[len(c['runs']) for c in result['campaigns'].values()]}, compares {len(result['grad_compare'])}")
EOF
run plot 120 $PY -m validation.e2e.plot_e2e "$OUT/e2e_results.json" --png "$OUT/e2e_loss.png" --md "$OUT/e2e_summary.md"
note "done in $(elapsed) s; files: $(ls "$OUT" | tr '\n' ' ')"
