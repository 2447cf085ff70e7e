#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/, by name, each resumed from its records file: a call cut
# short by its time limit is finished by the same command again.
#
#   bash benchmarks/run_plans.sh OUT NAME [NAME ...]      # on the GPU machine, from the repository root
#
# The GPU kit must be set up first (validation/convergence/README.md, Reproduce: `source .devkit/setup.sh`,
# which installs under /tmp/gp), and pretrain_gpt.py of each release must be under
# validation/convergence/_upstream/RELEASE/. Each plan's records file starts from SEED/FILE where it is
# there (SEED: default OUT/seed, the files an earlier call returned), else from benchmarks/results/FILE,
# and OUT/FILE gets every record; OUT/logs_NAME_GPU.tar.gz its processes' logs. Records files the call
# left unchanged are taken out of OUT.
#
# BUDGET: seconds this call may take (default 540); no process starts when too little is left.
# BASELINE_TREE: for autograd-fixes, a folder holding the gemm_patch of the version before that work
#   (`git archive 2262d25 gemm_patch | tar x -C DIR`).
# NOTE: the line every record carries (default: gemm_patch_ and the last commit that changed gemm_patch/, where
#   git knows it; a checkout without its history must give it). BENCH_ARGS: more pretrain_gpt_bench arguments.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/run_plans.sh OUT NAME [NAME ...]}
shift
[ $# -gt 0 ] || { echo "name one or more of: te-branch-tests gpu-tests autograd-fixes shapes-1b shapes-1b-0.17.1" \
  "shapes-3b shapes-3b-untied shapes-3b-manual-gc gc-probe-3b profile-3b optim-grads-0.17.1-untied" >&2; exit 2; }
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT"
SEED=${SEED:-$OUT/seed}
BUDGET=${BUDGET:-540}
NOTE=${NOTE:-$(git log -1 --format=gemm_patch_%h -- gemm_patch 2>/dev/null)}
[ -n "$NOTE" ] || { echo "NOTE: no git history here to name the gemm_patch measured; give NOTE=gemm_patch_COMMIT" >&2; exit 2; }
START=$SECONDS
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$GPU" in *H200*) TAG=h200 ;; *H100*) TAG=h100 ;; *) echo "no H100 or H200 seen ($GPU)" >&2; exit 2 ;; esac
export PYTHONPATH=$PWD:${PYTHONPATH:-}
say() { echo "[run_plans +$((SECONDS - START))s] $*" | tee -a "$OUT/run_plans.log"; }
left() { echo $((BUDGET - (SECONDS - START))); }

bench() {  # bench NAME FILE PROC_LIMIT ARGS...
  local name=$1 file=$2 limit=$3 l
  shift 3
  l=$(left)
  [ "$l" -ge $((limit + 30)) ] || { say "$name: not started, $l s left"; return; }
  if [ ! -f "$OUT/$file" ]; then  # a plan before it in this call may have written it already
    if [ -f "$SEED/$file" ]; then cp "$SEED/$file" "$OUT/$file"
    elif [ -f "benchmarks/results/$file" ]; then cp "benchmarks/results/$file" "$OUT/$file"
    else : > "$OUT/$file"; fi
    md5sum "$OUT/$file" > "$OUT/.$file.md5"
  fi
  say "$name -> $file ($l s left)"
  timeout $((l + 5)) python3 -m benchmarks.pretrain_gpt_bench --out "$OUT/$file" --logs "$OUT/logs_$name" \
    --kit /tmp/gp --resume --note "$NOTE" --deadline $((l - limit)) --proc-limit "$limit" "$@" ${BENCH_ARGS:-} >> "$OUT/run_plans.log" 2>&1
  say "$name: rc $?"
  if [ -d "$OUT/logs_$name" ]; then
    rm -rf "$OUT/logs_$name"/*_profile  # the profiler's traces (tens of MB each); the records hold their reading
    tar czf "$OUT/logs_${name}_$TAG.tar.gz" -C "$OUT" "logs_$name" && rm -rf "$OUT/logs_$name"
  fi
}

gpu_tests() {  # gpu_tests NAME SECONDS PYTEST_ARGS...
  local name=$1 limit=$2
  shift 2
  [ "$(left)" -ge "$limit" ] || { say "$name: not started, $(left) s left"; return; }
  say "$name"
  PYTHONPATH=$PWD:/tmp/gp/mc0171:$PYTHONPATH timeout "$limit" python3 -m pytest -q -rA -p no:cacheprovider "$@" \
    > "$OUT/${name}_$TAG.txt" 2>&1
  say "$name: rc $?"
}

LLAMA_PLAN=0.19.2:tied:fusion_off,0.19.2:tied:patched,0.19.2:tied:fixes_off
for name in "$@"; do
  case $name in
    te-branch-tests) gpu_tests "$name" 200 \
        tests/gpu/test_backends_gpu.py::test_upstream_te_branch_accumulates_into_persistent_buffers \
        tests/gpu/test_apex_gpu.py::test_megatron_layers_built_with_fusion_train_without_apex \
        tests/gpu/test_dummy_wgrad_gpu.py ;;
    gpu-tests) gpu_tests "$name" 300 tests/gpu ;;
    autograd-fixes) bench "$name" "pretrain_gpt_autograd_fixes_$TAG.jsonl" 150 --rounds 3 --iters 20 \
        --baseline-tree "${BASELINE_TREE:?BASELINE_TREE: the folder of the version before (see the top)}" \
        --plan 0.19.2:untied:fusion_off,0.19.2:untied:patched,0.19.2:untied:patched_baseline ;;
    shapes-1b) bench "$name" "shapes_llama3.2-1b_$TAG.jsonl" 150 --size llama3.2-1b --plan alternatives --rounds 3 ;;
    shapes-1b-0.17.1) bench "$name" "shapes_llama3.2-1b_$TAG.jsonl" 150 --size llama3.2-1b \
        --plan alternatives-0.17.1 --rounds 3 ;;
    shapes-3b) bench "$name" "shapes_llama3.2-3b_$TAG.jsonl" 150 --size llama3.2-3b --plan alternatives --rounds 3 ;;
    shapes-3b-untied) bench "$name" "shapes_llama3.2-3b_$TAG.jsonl" 150 --size llama3.2-3b \
        --plan alternatives-untied --rounds 3 ;;
    shapes-3b-manual-gc) bench "$name" "shapes_llama3.2-3b_$TAG.jsonl" 150 --size llama3.2-3b --manual-gc 100 \
        --plan "$LLAMA_PLAN" --rounds 3 ;;
    # How long Python's collector holds the host in the 3B's steps, under the collector's default setting.
    gc-probe-3b) bench "$name" "shapes_llama3.2-3b_$TAG.jsonl" 150 --size llama3.2-3b --gc-probe \
        --plan "$LLAMA_PLAN" --rounds 1 ;;
    # The profiler's iterations and the trace's writing take a 3B process past two minutes. With Python's call
    # stacks the 3B's trace was still being written when a process's time ran out: without them it reads the GPU's
    # work and idle time per step.
    profile-3b) bench "$name" "pretrain_gpt_profile_3b_$TAG.jsonl" 240 --size llama3.2-3b --iters 14 \
        --profile 10:12 --no-profile-stacks --plan "$LLAMA_PLAN" --rounds 1 ;;
    optim-grads-0.17.1-untied) bench "$name" "pretrain_gpt_optim_grads_$TAG.jsonl" 150 --strategy optim_grads \
        --rounds 3 --iters 20 --plan 0.17.1:untied:fusion_off,0.17.1:untied:patched,0.17.1:untied:fixes_off ;;
    *) say "unknown plan name: $name"; exit 2 ;;
  esac
done
for sum in "$OUT"/.*.md5; do
  [ -f "$sum" ] || continue
  md5sum -c --quiet "$sum" > /dev/null 2>&1 && rm -f "$OUT/$(basename "$sum" .md5 | sed 's/^\.//')"
  rm -f "$sum"
done
