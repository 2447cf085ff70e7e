#!/usr/bin/env bash
# validation/probes/built_before_apply.py on the H200: Megatron-LM's own pretrain_gpt.py (tied embedding,
# Megatron-FSDP optim_grads_params, fp32 main grads, 1 rank; benchmarks/pretrain_gpt_bench.py's hidden2048
# model), its model built before fsdp-shared-grad is applied and, as the reference, after. Both orders
# run at once; each writes OUT/built_before_apply_ORDER.log, and OUT/built_before_apply.json holds, per
# order, fsdp-shared-grad's state and reason after apply(), gemm_patch's WARNING lines and megatron's
# iteration-1 lm loss and grad norm, with the verdict: "as expected" when the early-built model is
# brought under the patch (verified after that apply() and at the end, no WARNING) and its iteration-1
# grad norm is the reference's within 0.5% (the lost embedding gradient moved it 1.5% where it was not).
#
#     bash validation/probes/built_before_apply_h200.sh OUT
#
# Needs what validation/compare/run_h200.sh needs (the GPU kit under KIT, pretrain_gpt.py of REL under
# validation/convergence/_upstream/REL). Environment: REL (0.19.2), ITERS (6), KIT (/tmp/gp), LIMIT (300 s
# per order), PY (python3).
set -u
OUT=${1:?usage: built_before_apply_h200.sh OUT}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
REL=${REL:-0.19.2}
ITERS=${ITERS:-6}
KIT=${KIT:-/tmp/gp}
LIMIT=${LIMIT:-300}
PY=${PY:-python3}
UP=$ROOT/validation/convergence/_upstream/$REL
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
[ -f "$UP/pretrain_gpt.py" ] || { echo "built_before_apply_h200.sh: $UP/pretrain_gpt.py not found"; exit 2; }
UP=$(cd "$UP" && pwd -P)  # the probe checks that its working folder is on PYTHONPATH
export PYTHONPATH="$UP:$KIT/mc${REL//./}:$KIT/site:$ROOT" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 KIT
unset CUDA_DEVICE_MAX_CONNECTIONS GEMM_PATCH GEMM_PATCH_DISABLE GEMM_PATCH_SHARED_GRAD GEMM_PATCH_TE_OVERWRITE
read -r -a args <<< "$("$PY" - "$REL" "$ITERS" <<'PY'
import os, shlex, sys
from benchmarks import pretrain_gpt_bench as bench
release, iters = sys.argv[1], int(sys.argv[2])
bench.prepare_kit(release, os.environ["KIT"])
print(shlex.join(bench.pretrain_args(release, bench.SIZES["hidden2048"], True, iters) + ["--log-interval", "1"]))
PY
)"
for order in before after; do
    (cd "$UP" && timeout -s TERM "$LIMIT" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
        "$ROOT/validation/probes/built_before_apply.py" --order "$order" -- "${args[@]}") \
        > "$OUT/built_before_apply_$order.log" 2>&1 &
done
wait
"$PY" - "$OUT" "$REL" "${args[*]}" <<'PY'
import json, re, subprocess, sys
from pathlib import Path

out, release, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
record = {"entry": "pretrain_gpt.py", "release": release, "ranks": 1, "args": args,
          "device": subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                   capture_output=True, text=True).stdout.strip()}
for order in ("before", "after"):
    text = (out / f"built_before_apply_{order}.log").read_text(errors="replace")
    probes = [json.loads(m) for m in re.findall(r"^built-before-apply: (\{.*\})$", text, re.M)]
    it1 = re.search(r"iteration\s+1/.*?lm loss: ([0-9.E+-]+).*?grad norm: ([0-9.naif]+)", text)
    record[order] = {"probe": probes, "warnings": re.findall(r"^\[gemm_patch\] WARNING: .*$", text, re.M),
                     "lm_loss_1": float(it1.group(1)) if it1 else None,
                     "grad_norm_1": float(it1.group(2)) if it1 else None}
b, a = record["before"], record["after"]
states = {o: (record[o]["probe"][0]["state"] if record[o]["probe"] else None) for o in ("before", "after")}
ends = [p["state"] for p in b["probe"][1:]]
ok = (states["before"] == "verified" and states["after"] == "verified" and ends == ["verified"]
      and not b["warnings"] and None not in (b["grad_norm_1"], a["grad_norm_1"])
      and abs(b["grad_norm_1"] - a["grad_norm_1"]) <= 5e-3 * abs(a["grad_norm_1"]))
record["verdict"] = "as expected" if ok else "NOT as expected"
(out / "built_before_apply.json").write_text(json.dumps(record, indent=1) + "\n")
print(json.dumps({o: {"state": states[o], "warnings": len(record[o]["warnings"]),
                      "grad_norm_1": record[o]["grad_norm_1"]} for o in ("before", "after")}), record["verdict"])
PY
