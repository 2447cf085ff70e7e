#!/usr/bin/env bash
# `gemm-patch compare` on Megatron-LM's own pretrain_gpt.py on the H200, one JSON record per case
# (OUT/CASE.json, compare's --json: both command lines, every logged iteration, the per-parameter
# judgement), its table (OUT/CASE.txt), the runs' logs and gradient-probe records
# (OUT/logs_CASE.tar.gz), and OUT/summary.txt (each case's verdict against the one expected):
#
#     bash validation/compare/run_h200.sh OUT [CASE ...]
#
# Cases (default: dense_tied_1 dense_tied_2 fixes_off_1 fixes_off_2 moe_1; about 3-6 minutes each: a few per call):
#   dense_tied_1    hidden 2048, 4 layers, tied embedding, Megatron-FSDP optim_grads_params, 1 rank: same
#   dense_tied_2    the same on 2 data-parallel ranks sharing the one GPU (rank_on_gpu0.sh): same
#   fixes_off_1     dense_tied_1 with gemm-patch's correctness fixes off (GEMM_PATCH_SHARED_GRAD=0
#                   GEMM_PATCH_TE_OVERWRITE=0: upstream's fused behaviour): differs at iteration 1,
#                   naming the parameter (the tied embedding)
#   fixes_off_2     the same on 2 ranks
#   tied_mtp_N      dense_tied_N with one MTP layer (rope): the tied output layer is used twice per
#                   backward, into a fresh gradient bucket at 2 ranks: same (REL=0.15.3 too); at 8
#                   ranks each rank takes one micro-batch of 1 (global batch 8 at every rank count)
#   tied_mtp_fixes_off_N   the same with the correctness fixes off: differs (exit 1): at iteration 1, or,
#                   on 0.14-0.15, the fused run fails with megatron's own error (its hook freed the bucket)
#   moe_1           4 experts, top-2, grouped GEMM, Megatron-FSDP optim_grads, untied, 1 rank: not "differs"
#                   (the router is not run-to-run deterministic; compare measures that drift)
#   moe_ep2_2       moe_1 with expert parallelism 2 on 2 ranks, the fusion-off run under gemm-patch too
#                   (--off-patched: only fusion differs): not "differs"
#
# Needs (as validation/convergence/run.sh): the GPU kit installed (`source .devkit/setup.sh`: TE and
# megatron-core under KIT=/tmp/gp), validation/convergence/_upstream/REL/pretrain_gpt.py and its
# neighbours (validation/convergence/README.md, "Reproduce"), rank_on_gpu0.sh of the kit (DEVKIT,
# default validation/convergence/_kit/.devkit, else .devkit). Model and flags: those of
# benchmarks/pretrain_gpt_bench.py --size hidden2048 (mock data, NullTokenizer), megatron's
# iteration line every iteration.
# Environment: REL (0.19.2), ITERS (10), KIT (/tmp/gp), DEVKIT, LIMIT (seconds per case, 540), PY (python3),
# PORT (29971; the 2-rank cases' rendezvous: give each of two scripts running at once its own).
set -u
OUT=${1:?usage: run_h200.sh OUT [CASE ...]}
shift
CASES=${*:-dense_tied_1 dense_tied_2 fixes_off_1 fixes_off_2 moe_1}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
REL=${REL:-0.19.2}
ITERS=${ITERS:-10}
KIT=${KIT:-/tmp/gp}
PY=${PY:-python3}
LIMIT=${LIMIT:-540}
PORT=${PORT:-29971}
DEVKIT=${DEVKIT:-$ROOT/validation/convergence/_kit/.devkit}
[ -f "$DEVKIT/rank_on_gpu0.sh" ] || DEVKIT=$ROOT/.devkit
UP=$ROOT/validation/convergence/_upstream/$REL
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
[ -f "$UP/pretrain_gpt.py" ] || { echo "run_h200.sh: $UP/pretrain_gpt.py not found"; exit 2; }
export PYTHONPATH="$KIT/mc${REL//./}:$KIT/site:$ROOT" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 KIT ROOT
unset CUDA_DEVICE_MAX_CONNECTIONS GEMM_PATCH GEMM_PATCH_SHARED_GRAD GEMM_PATCH_TE_OVERWRITE
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/device.txt" 2>&1

# pretrain_gpt.py's flags, from the benchmark (one definition of the model): dense or moe
model_args() {
    "$PY" - "$REL" "$ITERS" "$1" "$2" <<'PY'
import os, shlex, sys
from benchmarks import pretrain_gpt_bench as bench  # ROOT is on PYTHONPATH
release, iters, kind, ranks = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
bench.prepare_kit(release, os.environ["KIT"])  # the no-op Makefile megatron's initialize wants
size = dict(bench.SIZES["hidden2048"])
# the same global batch at every rank count: fewer micro-batches per rank, then smaller ones
# (megatron wants the global batch divisible by micro-batch x data-parallel ranks)
size["mbs"] = max(1, min(size["mbs"], size["gbs"] // ranks))
args = bench.pretrain_args(release, size, not kind.startswith("moe"), iters) + ["--log-interval", "1"]
if kind == "mtp":  # the tied output layer used twice per backward: the main model and the MTP layer
    args += ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
if kind.startswith("moe"):
    args[args.index("optim_grads_params")] = "optim_grads"
    args += ["--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm", "--moe-ffn-hidden-size", "2048",
             "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "1e-2", "--disable-bias-linear"]
if kind == "moe_ep2":
    args += ["--expert-model-parallel-size", "2"]
print(shlex.join(args))
PY
}

launcher() {  # 1 rank: torchrun; N > 1 ranks: all on GPU 0 through NCCL's socket transport (cases ending _4, _8)
    if [ "$1" = 1 ]; then echo "$PY -m torch.distributed.run --standalone --nproc-per-node 1"
    else echo "$PY -m torch.distributed.run --no-python --nproc-per-node $1 --master-port $PORT $DEVKIT/rank_on_gpu0.sh $PY"
    fi
}

for case in $CASES; do
    ranks=${case##*_}
    opts=()
    case $case in
        dense_tied_*) kind=dense; env=(); expect="same:" ;;  # judged per parameter, not "global values only"
        tied_mtp_fixes_off_*) kind=mtp; env=(GEMM_PATCH_SHARED_GRAD=0 GEMM_PATCH_TE_OVERWRITE=0); expect="differs" ;;
        tied_mtp_*) kind=mtp; env=(); expect="same:" ;;
        fixes_off_*) kind=dense; env=(GEMM_PATCH_SHARED_GRAD=0 GEMM_PATCH_TE_OVERWRITE=0); expect="differs at iteration 1: parameter" ;;
        moe_ep2_*) kind=moe_ep2; env=(); opts=(--off-patched); expect="not differs" ;;
        moe_*) kind=moe; env=(); expect="not differs" ;;
        *) echo "run_h200.sh: unknown case $case (dense_tied_N, fixes_off_N, tied_mtp_N, tied_mtp_fixes_off_N, moe_1, moe_ep2_2)"; exit 2 ;;
    esac
    read -r -a args <<< "$(model_args $kind "$ranks")"
    [ "${#args[@]}" -gt 10 ] || { echo "run_h200.sh: could not build pretrain_gpt.py's flags"; exit 2; }
    read -r -a launch <<< "$(launcher "$ranks")"
    rm -rf "$OUT/logs/$case"
    echo "== $case ($(date -u +%FT%TZ)): ${env[*]} gemm-patch compare --iters $ITERS ${opts[*]} -- ${launch[*]} pretrain_gpt.py ..."
    (cd "$UP" && env "${env[@]}" timeout -s TERM "$LIMIT" "$PY" -m gemm_patch compare --iters "$ITERS" "${opts[@]}" \
        --logs "$OUT/logs/$case" --json "$OUT/$case.json" -- "${launch[@]}" pretrain_gpt.py "${args[@]}") \
        > "$OUT/$case.txt" 2>&1
    rc=$?
    tar -czf "$OUT/logs_$case.tar.gz" -C "$OUT/logs" "$case" && rm -rf "${OUT:?}/logs/$case"
    "$PY" -m validation.trim_logs "$OUT/logs_$case.tar.gz" > /dev/null  # megatron's argument list, repeated warnings
    verdict=$(grep -m1 '^verdict: ' "$OUT/$case.txt" | cut -c10-)
    case $expect in
        "not differs") [ "$rc" != 1 ] && ok=as-expected || ok=NOT-AS-EXPECTED ;;
        differs) [ "$rc" = 1 ] && ok=as-expected || ok=NOT-AS-EXPECTED ;;  # a parameter, or the fused run failed
        *) [[ "$verdict" == "$expect"* ]] && ok=as-expected || ok=NOT-AS-EXPECTED ;;
    esac
    echo "$case | exit $rc | $ok (expected: $expect) | $verdict" | tee -a "$OUT/summary.txt"
    grep -m3 '^gemm-patch compare: .*failed\|^  exception\|not proven' "$OUT/$case.txt"
done
