#!/bin/bash
# NeMo 2.7.3 on the H200: nemo_step.py on megatron-core 0.15.3, two runs at a time
# (one GPU each), then the first step's gradients of each fused run against NeMo's own
# fusion-off run, parameter by parameter (validation/parity/compare_grads.py).
#
#   bash validation/frameworks/nemo/run_h200.sh OUT        (from the repository root, on the GPU machine)
#
# Needs the GPU kit (.devkit: setup.sh, TE, wheels) and .nemo273 (validation/frameworks/nemo/pack_wheels.sh).
# Runs (RUNS, default all): <how>_<tied|untied>, how = gaf (gemm-patch run with
# GEMM_PATCH_NEMO_FSDP_GAF=1: NeMo keeps fusion), patched (gemm-patch run, NeMo's own switch-off),
# plain (fusion asked for, no gemm-patch), off (fusion off, no gemm-patch: the oracle).
# Writes OUT/nemo_h200.tgz: results/nemo_<run>.json, results/compare_<run>.json per fused run,
# logs/<run>.log (one file: the device returns few).
set -u
OUT=${1:?usage: bash validation/frameworks/nemo/run_h200.sh OUT}
RUNS=${RUNS:-"gaf_tied off_tied gaf_untied off_untied patched_tied plain_tied"}
[ -d .nemo273/wheels ] || { echo "carry .nemo273 (validation/frameworks/nemo/pack_wheels.sh)"; exit 3; }
shopt -s nullglob
unset PYTHONPATH
source .devkit/setup.sh || { echo "GPU kit setup failed"; exit 1; }
N=/tmp/nemosite W=/tmp/nemo_work
mkdir -p "$W/dumps" "$W/logs" "$W/results" "$OUT"
[ -d $N/nemo ] || python3 -m pip install -q --no-index --no-deps --no-compile --target $N .nemo273/wheels/*.whl
[ -d /tmp/gp/mc0153/megatron ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gp/mc0153 .nemo273/mc/*.whl
mcore 0.15.3
export PYTHONPATH=$N:$PYTHONPATH:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MASTER_ADDR=127.0.0.1
# 0.15.x builds a C++ extension when megatron.core is first imported: once, before the runs.
timeout 240 python3 -c 'import time; t = time.time(); import megatron.core.inference.unified_memory as u; print("[mc0153] unified-memory extension", u.has_unified_memory, round(time.time() - t), "s")' 2>&1 | tail -1

one_run() {  # one_run NAME GPU
  local name=$1 how=${1%_*} tied=on launcher="" fusion=on
  [ "${1#*_}" = untied ] && tied=off
  case $how in
    gaf) launcher="env GEMM_PATCH_NEMO_FSDP_GAF=1 python3 -m gemm_patch run --";;
    patched) launcher="python3 -m gemm_patch run --";;
    off) fusion=off;;
  esac
  CUDA_VISIBLE_DEVICES=$2 MASTER_PORT=$((29500 + $2)) timeout 200 $launcher python3 -m validation.frameworks.nemo.nemo_step \
    --fusion $fusion --tied $tied --grad-dump "$W/dumps/$name.pt" --out "$W/results/nemo_$name.json" \
    --log-dir "$W/nemo_logs_$name" > "$W/logs/$name.log" 2>&1
  echo "== $name (GPU $2) rc=$?"
  grep -a "nemo_step\]" "$W/logs/$name.log" | grep -v "^.*layer " | cut -c1-300
}

GPUS=$(nvidia-smi -L | wc -l)
set -- $RUNS
while [ $# -gt 0 ]; do
  if [ "$GPUS" -ge 2 ] && [ $# -ge 2 ]; then
    one_run "$1" 0 > "$W/lane0.txt" & one_run "$2" 1 > "$W/lane1.txt"; wait
    cat "$W/lane0.txt" "$W/lane1.txt"; shift 2
  else
    one_run "$1" 0; shift
  fi
done

# The first step's gradients of each fused run against the fusion-off run of the same model.
: > "$W/spec.txt"
for r in $RUNS; do
  case $r in off_*) continue;; esac
  [ -f "$W/dumps/$r.pt" ] && [ -f "$W/dumps/off_${r#*_}.pt" ] && echo "$r $W/dumps/$r.pt $W/dumps/off_${r#*_}.pt -" >> "$W/spec.txt"
done
python3 -m validation.parity.compare_grads --batch "$W/spec.txt" --out-dir "$W/results" 2>&1 | tail -12
tar czf "$OUT/nemo_h200.tgz" -C "$W" results logs spec.txt
