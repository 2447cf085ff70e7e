#!/bin/bash
# The H200 gradient-parity campaigns (see run_coverage.py): every layout (default) or, with
# --campaign tied-weights, tied embeddings and MTP. On the GPU machine, from the repository root, with the GPU
# kit (.devkit, built by EXTRA_WHEELS=einops ../shared/device/prepare.sh 0.17.1 0.19.2: Megatron-FSDP
# needs einops for TP/CP/EP meshes) carried along; tied-weights also needs gemm-patch 0.1.0 in .baseline/
# (git archive 4c56ac3 gemm_patch | tar -x -C .baseline):
#
#   bash validation/parity/run_coverage.sh OUT [run_coverage.py options, e.g. --smoke]
#
# The layouts campaign writes OUT/layouts_rows.json and layouts_run.json (this run), coverage.json,
# coverage_runs.json and coverage.md (validation/results merged with this run),
# coverage_details_layouts.json.gz and coverage_logs_layouts.txt.gz.
set -u
OUT=${1:?usage: bash validation/parity/run_coverage.sh OUT [options]}
shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source .devkit/setup.sh || { echo "GPU kit setup failed"; exit 1; }
python3 -c "import einops" 2>/dev/null || echo "WARNING: einops missing: TP/CP/EP layouts will fail in Megatron-FSDP's mesh"
case " $* " in *" --campaign tied-weights"*) [ -d .baseline/gemm_patch ] || echo "WARNING: .baseline/gemm_patch missing";; esac
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
python3 -m validation.parity.run_coverage --out "$OUT" "$@"
