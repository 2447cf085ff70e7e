#!/usr/bin/env bash
# Convergence of Megatron-LM's own pretrain_gpt.py on byte-level Python stdlib text, Megatron-FSDP
# (optim_grads_params, fp32 main grads, bf16), one GPU, one megatron-core release per call:
#
#     bash validation/convergence/run.sh OUT RELEASE [MODE]
#
# MODE convergence (default): a 20-iteration dry run (patched), the unpatched run (GEMM_PATCH=0),
#   then patched / fusion_off seed 1234 / fusion_off seed 1235 / correctness_off at the same time
#   on the one GPU (4 processes; their step times are measured while sharing it).
# MODE speed: hidden 2048, 3 rounds of patched / fusion_off / bf16 main grads, one process at a time,
#   the order turning each round.
# MODE moe: 8 experts, --moe-grouped-gemm, a 20-iteration dry run, then 3 seeds (MOE_SEEDS) of each
#   configuration in MOE_CONFIGS (default: patched fusion_off; also correctness_off), all at once.
# MODE seeds: same-seed pairs of the dense model: for each seed in SEEDS (default 1236 1237 1238 1239),
#   patched and fusion_off, ITERS iterations, all at once on the one GPU (2 processes per seed). Each
#   process's record (OUT/seeds_RELEASE/RUN.json) and log are written to OUT as that process ends, so a
#   run cut off by PROC_LIMIT still leaves its record (rc 124, the iterations it reached).
# MODE finegrained: Megatron-FSDP's fine-grained parameter-gather hooks on
#   (--megatron-fsdp-enable-fine-grained-param-gather, 0.18+), 30 iterations, patched and fusion_off
#   side by side (a weight used twice per backward: the tied embedding).
#
# Needs: the GPU kit installed (source .devkit/setup.sh: TE and megatron-core under /tmp/gp/mcXYZ),
# validation/convergence/_upstream/RELEASE/ (pretrain_gpt.py, gpt_builders.py, model_provider.py
# and, for 0.17.1, megatron/legacy, from Megatron-LM's git tag), this checkout (gemm_patch from
# source). Writes OUT/results_RELEASE_MODE.json (validation/convergence/parse_logs.py) and
# OUT/logs_RELEASE_MODE.tar.gz (every process log, versions.json, the data summary).
#
# Environment: ITERS (1000), EVAL_INTERVAL (100), PROC_LIMIT (seconds per process, 300), SEEDS (seeds mode),
# DEADLINE (no process starts after this many seconds, 500), PY (python3).
set -u
OUT=${1:?usage: run.sh OUT RELEASE [MODE]}
REL=${2:?usage: run.sh OUT RELEASE [MODE]}
MODE=${3:-convergence}
PY=${PY:-python3}
ITERS=${ITERS:-1000}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
PROC_LIMIT=${PROC_LIMIT:-300}
DEADLINE=${DEADLINE:-500}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$ROOT/validation/convergence"
UP="$HERE/_upstream/$REL"
LOGS="/tmp/gp_convergence_logs/$REL/$MODE"  # archived into OUT at the end
DATA=/tmp/gp_convergence_data
T0=$(date +%s)
rm -rf "$LOGS"; mkdir -p "$LOGS" "$OUT"
export PYTHONPATH="/tmp/gp/mc${REL//./}:/tmp/gp/site:$ROOT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
unset CUDA_DEVICE_MAX_CONNECTIONS GEMM_PATCH_TE_OVERWRITE GEMM_PATCH_SHARED_GRAD GEMM_PATCH
elapsed() { echo $(( $(date +%s) - T0 )); }
echo "== $REL $MODE start $(date -u +%FT%TZ)"

# -- data (the device's own stdlib; a few seconds) and versions
if [ ! -f "$DATA/stdlib_bytes.idx" ]; then
    $PY -m validation.convergence.make_data "$DATA" 2>/dev/null > "$DATA.txt" || { echo "make_data failed"; cat "$DATA.txt"; exit 1; }
fi
cp "$DATA/stdlib_bytes.json" "$DATA.txt" "$LOGS/"
cat "$DATA.txt"
# megatron's initialize runs `make` in megatron/core/datasets; the wheel ships the compiled
# helpers_cpp but no Makefile: a no-op one lets that step pass
MK="/tmp/gp/mc${REL//./}/megatron/core/datasets/Makefile"
[ -f "$MK" ] || printf 'default:\n\t@true\n' > "$MK"
$PY - > "$LOGS/versions.json" 2>/dev/null <<'EOF'
import json, sys, torch
v = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
     "gpu": torch.cuda.get_device_name(0)}
try:
    import transformer_engine; v["transformer_engine"] = transformer_engine.__version__
except Exception as e: v["transformer_engine"] = repr(e)
from megatron.core import package_info; v["megatron_core"] = package_info.__version__
import gemm_patch; v["gemm_patch"] = getattr(gemm_patch, "__version__", "?")
print(json.dumps(v))
EOF
cat "$LOGS/versions.json"

# NullTokenizer: 0.17.1 takes N = 256 (vocab N + 1, eod N); 0.19.x takes N = 257 (vocab N, eod N - 1).
case "$REL" in 0.17.*|0.16.*|0.15.*) VOCAB=256 ;; *) VOCAB=257 ;; esac

common_args() {  # HIDDEN LAYERS HEADS SEQ MBS ITERS
    local hidden=$1 layers=$2 heads=$3 seq=$4 mbs=$5 iters=$6
    echo --num-layers "$layers" --hidden-size "$hidden" --num-attention-heads "$heads" \
        --ffn-hidden-size $((4 * hidden)) --seq-length "$seq" --max-position-embeddings "$seq" \
        --micro-batch-size "$mbs" --global-batch-size $((4 * mbs)) --train-iters "$iters" \
        --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 50 --weight-decay 0.1 \
        --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 \
        --bf16 --transformer-impl transformer_engine \
        --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params \
        --megatron-fsdp-main-grads-dtype fp32 --use-distributed-optimizer --ckpt-format fsdp_dtensor \
        --tokenizer-type NullTokenizer --vocab-size "$VOCAB" --make-vocab-size-divisible-by 128 \
        --data-path "$DATA/stdlib_bytes" --split 95,5,0 --num-workers 1 \
        --eval-interval "$EVAL_INTERVAL" --eval-iters 10 --log-interval 10 \
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
}

# train NAME SEED [VAR=VALUE ...] -- [EXTRA ARGS ...]: one torchrun process under `gemm-patch run`.
train() {
    local name=$1 seed=$2; shift 2
    local -a envs=() extra=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
    [ "${1:-}" = "--" ] && shift
    extra=("$@")
    if [ "$(elapsed)" -gt "$DEADLINE" ]; then
        echo "== $name: skipped, t=$(elapsed)s > DEADLINE=$DEADLINE" | tee "$LOGS/$name.log"
        return 0
    fi
    echo "== $name start t=$(elapsed)s: ${envs[*]} seed=$seed ${extra[*]}"
    local start=$(date +%s)
    {
        echo "COMMAND: env ${envs[*]} $PY -m gemm_patch run -- $PY -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py ${ARGS[*]} --seed $seed ${extra[*]}"
        (cd "$UP" && timeout -k 10 "$PROC_LIMIT" env "${envs[@]}" $PY -m gemm_patch run -- \
            $PY -m torch.distributed.run --standalone --nproc-per-node 1 pretrain_gpt.py \
            "${ARGS[@]}" --seed "$seed" "${extra[@]}" < /dev/null)
        echo "EXIT: rc=$? seconds=$(( $(date +%s) - start ))"
    } > "$LOGS/$name.log" 2>&1
    echo "== $name done t=$(elapsed)s: $(tail -1 "$LOGS/$name.log")"
}

# train_and_record NAME SEED [VAR=VALUE ...] -- [EXTRA ARGS ...]: train, then at once that run's record and
# log into OUT (the seeds mode, whose processes end at different times)
train_and_record() {
    local name=$1 dir="$OUT/seeds_$REL"
    train "$@"
    mkdir -p "$dir"
    cp "$LOGS/$name.log" "$dir/"
    $PY -m validation.convergence.parse_logs --release "$REL" --mode seeds --log "$LOGS/$name.log" --out "$dir/$name.json" \
        | sed 's/^/   /'
}

case "$MODE" in
seeds)
    read -r -a ARGS <<< "$(common_args 512 4 8 512 8 "$ITERS")"
    for s in ${SEEDS:-1236 1237 1238 1239}; do
        train_and_record "patched_s$s" "$s" & sleep 2
        train_and_record "fusion_off_s$s" "$s" -- --no-gradient-accumulation-fusion & sleep 2
    done
    wait
    ;;
convergence)
    read -r -a ARGS <<< "$(common_args 512 4 8 512 8 "$ITERS")"
    # dry run: flag errors show here in ~1 min
    ITERS_DRY=(--train-iters 20 --eval-interval 10 --lr-warmup-iters 5)
    train dry 1234 GEMM_PATCH_LOG_LEVEL=INFO -- "${ITERS_DRY[@]}"
    if ! grep -q "iteration  *20/ *20" "$LOGS/dry.log"; then
        echo "dry run failed:"; grep -v "^  " "$LOGS/dry.log" | tail -40
        tar czf "$OUT/logs_${REL}_${MODE}.tar.gz" -C "$LOGS" .; exit 1
    fi
    # unpatched (GEMM_PATCH=0 turns gemm-patch off entirely: megatron runs as shipped)
    train unpatched 1234 GEMM_PATCH=0
    train patched 1234 &
    sleep 5; train fusion_off 1234 -- --no-gradient-accumulation-fusion &
    sleep 5; train fusion_off_seed1235 1235 -- --no-gradient-accumulation-fusion &
    sleep 5; train correctness_off 1234 GEMM_PATCH_SHARED_GRAD=0 GEMM_PATCH_TE_OVERWRITE=0 &
    wait
    ;;
speed)
    read -r -a ARGS <<< "$(common_args 2048 4 16 2048 2 "${SPEED_ITERS:-60}")"
    ARGS+=(--eval-iters 0)
    # the order turns each round, so no configuration always runs first on a cold GPU
    for round in 1 2 3; do
        case $round in
            1) order="patched fusion_off bf16_grads" ;;
            2) order="fusion_off bf16_grads patched" ;;
            3) order="bf16_grads patched fusion_off" ;;
        esac
        for config in $order; do
            case "$config" in
                patched) train "speed_patched_r$round" 1234 ;;
                fusion_off) train "speed_fusion_off_r$round" 1234 -- --no-gradient-accumulation-fusion ;;
                bf16_grads) train "speed_bf16_grads_r$round" 1234 -- --megatron-fsdp-main-grads-dtype bf16 ;;
            esac
        done
    done
    ;;
finegrained)
    read -r -a ARGS <<< "$(common_args 512 4 8 512 8 "${ITERS_FG:-30}")"
    ARGS+=(--megatron-fsdp-enable-fine-grained-param-gather --eval-interval 30 --lr-warmup-iters 5)
    train fg_patched 1234 &
    sleep 3; train fg_fusion_off 1234 -- --no-gradient-accumulation-fusion &
    wait
    grep -h "iteration  *30/" "$LOGS"/fg_*.log | sed 's/^/  /'
    ;;
moe)
    read -r -a ARGS <<< "$(common_args 512 4 8 512 8 "$ITERS")"
    ARGS+=(--num-experts 8 --moe-router-topk 2 --moe-grouped-gemm --moe-ffn-hidden-size 1024
           --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2
           --disable-bias-linear)  # TEGroupedMLP refuses bias-dropout fusion with biases
    # a 20-iteration dry run first: a flag error shows in about a minute
    train moe_dry 1234 GEMM_PATCH_LOG_LEVEL=INFO -- --train-iters 20 --eval-interval 10 --lr-warmup-iters 5
    if ! grep -q "iteration  *20/ *20" "$LOGS/moe_dry.log"; then
        echo "dry run failed:"; grep -v "^  " "$LOGS/moe_dry.log" | tail -40
        tar czf "$OUT/logs_${REL}_${MODE}.tar.gz" -C "$LOGS" .; exit 1
    fi
    for config in ${MOE_CONFIGS:-patched fusion_off}; do
        case "$config" in
            patched) envs=(); extra=() ;;
            fusion_off) envs=(); extra=(--no-gradient-accumulation-fusion) ;;
            correctness_off) envs=(GEMM_PATCH_SHARED_GRAD=0 GEMM_PATCH_TE_OVERWRITE=0); extra=() ;;
            *) echo "MOE_CONFIGS: unknown config $config (patched, fusion_off, correctness_off)"; exit 2 ;;
        esac
        for s in ${MOE_SEEDS:-1234 1235 1236}; do
            train "moe_${config}_s$s" "$s" "${envs[@]}" -- "${extra[@]}" & sleep 3
        done
    done
    wait
    ;;
esac
$PY -m validation.convergence.parse_logs --release "$REL" --mode "$MODE" --logs "$LOGS" --out "$OUT/results_${REL}_${MODE}.json"
tar czf "$OUT/logs_${REL}_${MODE}.tar.gz" -C "$LOGS" .
echo "== $REL $MODE end t=$(elapsed)s"
