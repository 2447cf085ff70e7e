#!/bin/bash
# The H200 gradient-parity campaigns (see run_coverage.py): issue 10's layouts (default) or, with
# --issue 13, tied embeddings and MTP. On the GPU machine, from the repository root, with the GPU
# kit (.devkit, built by EXTRA_WHEELS=einops ../shared/device/prepare.sh 0.17.1 0.19.2: Megatron-FSDP
# needs einops for TP/CP/EP meshes) carried along; issue 13 also needs gemm-patch 0.1.0 in .baseline/
# (git archive 4c56ac3 gemm_patch | tar -x -C .baseline):
#
#   bash examples/run_coverage.sh OUT [run_coverage.py options, e.g. --smoke]
#
# Issue 10 writes OUT/coverage10_rows.json and coverage10_run.json (this call), coverage.json,
# coverage_runs.json and coverage.md (examples/results merged with this call),
# coverage10_details.json.gz and coverage10_logs.txt.gz.
set -u
OUT=${1:?usage: bash examples/run_coverage.sh OUT [options]}
shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source .devkit/setup.sh || { echo "GPU kit setup failed"; exit 1; }
python3 -c "import einops" 2>/dev/null || echo "WARNING: einops missing: TP/CP/EP layouts will fail in Megatron-FSDP's mesh"
case " $* " in *" --issue 13"*) [ -d .baseline/gemm_patch ] || echo "WARNING: .baseline/gemm_patch missing";; esac
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
python3 examples/run_coverage.py --out "$OUT" "$@"
