#!/bin/bash
# Issue 13's H200 campaign (tied embeddings and MTP on Megatron-FSDP; see run_coverage.py).
# On the GPU machine, from the repository root, with the GPU kit (.devkit, built by
# ../shared/device/prepare.sh 0.17.1 0.19.2) and gemm-patch 0.1.0 in .baseline/
# (git archive 4c56ac3 gemm_patch | tar -x -C .baseline) carried along:
#
#   bash examples/run_coverage.sh OUT [run_coverage.py options, e.g. --releases 0.17.1,0.19.2]
#
# Writes OUT/coverage.json, coverage.md, coverage_details.json.gz, coverage_logs.txt.gz.
set -u
OUT=${1:?usage: bash examples/run_coverage.sh OUT [options]}
shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source .devkit/setup.sh || { echo "GPU kit setup failed"; exit 1; }
[ -d .baseline/gemm_patch ] || echo "WARNING: .baseline/gemm_patch missing: the 'before' configuration will fail"
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
python3 examples/run_coverage.py --out "$OUT" "$@"
