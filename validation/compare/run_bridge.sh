#!/usr/bin/env bash
# `gemm-patch compare` on a Megatron-Bridge recipe on one GPU: Bridge's own pretrain() with its
# vanilla_gpt recipe scaled down (validation/frameworks/bridge/bridge_pretrain.py: 4 layers, hidden 512,
# tied embeddings, Megatron-FSDP optim_grads_params, fp32 main grads, 4 micro-batches a step, every
# iteration logged), fusion at Bridge's default (on) against `--fusion off`. Bridge prints no
# argument dump, so compare proves the toggle from the probe's reading of the model's configuration.
# Writes OUT/bridge_1.json (compare's --json), OUT/bridge_1.txt (its table), OUT/logs_bridge_1.tar.gz
# and a line in OUT/summary.txt (expected: same).
#
#     bash validation/compare/run_bridge.sh OUT
#
# Needs: the GPU kit installed under KIT (/tmp/gp: TE, megatron-core 0.19.2), Bridge 0.6.2 and its
# import set under BSITE (/tmp/bsite62); validation/frameworks/bridge/README.md ("Reproducing") installs
# both. Environment: ITERS (8), KIT, BSITE, LIMIT (seconds, 540), PY (python3).
set -u
OUT=${1:?usage: run_bridge.sh OUT}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
ITERS=${ITERS:-8}
KIT=${KIT:-/tmp/gp}
BSITE=${BSITE:-/tmp/bsite62}
PY=${PY:-python3}
LIMIT=${LIMIT:-540}
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
[ -d "$BSITE/megatron/bridge" ] || { echo "run_bridge.sh: Bridge not installed under $BSITE"; exit 2; }
export PYTHONPATH="$KIT/mc0192:$KIT/site:$BSITE:$ROOT" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
unset CUDA_DEVICE_MAX_CONNECTIONS GEMM_PATCH GEMM_PATCH_SHARED_GRAD GEMM_PATCH_TE_OVERWRITE  # Bridge asserts != 1
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/device.txt" 2>&1
# Bridge's initialize runs megatron's compile_helpers (make): the wheel ships helpers_cpp prebuilt
"$PY" -c "from benchmarks import pretrain_gpt_bench as b; b.prepare_kit('0.19.2', '$KIT')" || exit 2
if ! command -v make > /dev/null; then
    mkdir -p /tmp/br/shim && printf '#!/bin/sh\nexit 0\n' > /tmp/br/shim/make && chmod +x /tmp/br/shim/make
    export PATH=/tmp/br/shim:$PATH
fi
case=bridge_1
rm -rf "$OUT/logs/$case"
echo "== $case ($(date -u +%FT%TZ)): gemm-patch compare --iters $ITERS -- torchrun 1 rank bridge_pretrain"
(cd "$ROOT" && timeout -s TERM "$LIMIT" "$PY" -m gemm_patch compare --iters "$ITERS" --iters-arg="--iters {n}" \
    --off-arg=--fusion --off-arg=off --logs "$OUT/logs/$case" --json "$OUT/$case.json" -- \
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m validation.frameworks.bridge.bridge_pretrain --out /tmp/br/run --gbs 8) > "$OUT/$case.txt" 2>&1
rc=$?
tar -czf "$OUT/logs_$case.tar.gz" -C "$OUT/logs" "$case" && rm -rf "${OUT:?}/logs/$case"
"$PY" -m validation.trim_logs "$OUT/logs_$case.tar.gz" > /dev/null
verdict=$(grep -m1 '^verdict: ' "$OUT/$case.txt" | cut -c10-)
[[ "$verdict" == same:* ]] && ok=as-expected || ok=NOT-AS-EXPECTED
echo "$case | exit $rc | $ok (expected: same) | $verdict" | tee -a "$OUT/summary.txt"
grep -m3 '^gemm-patch compare: .*failed\|^  exception\|not proven' "$OUT/$case.txt"
tail -25 "$OUT/$case.txt"
