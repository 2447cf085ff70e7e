#!/bin/bash
# Pack the wheels a NeMo 2.7.3 step needs on the H200 beside the image and .devkit (no dependencies:
# each one pinned, as traced in validation/notes/frameworks.md, "NeMo 2.7.3: the import chain").
#
#   run from the project root (needs PyPI):   validation/frameworks/nemo/pack_wheels.sh
#
# Fills .nemo273/wheels (46 wheels: nemo-toolkit, Lightning 2.4.0, NeMo's import chain; two of them
# built here from their sdists, pure Python) and .nemo273/mc (megatron-core 0.15.3, cp312: the newest
# release whose get_megatron_optimizer takes NeMo 2.7.3's no_weight_decay_cond / scale_lr_cond / lr_mult;
# validation/frameworks/nemo/README.md says why), and adds .nemo273/ to .git/info/exclude. 27.91 MB (27,912,390 bytes).
set -euo pipefail
D=.nemo273
PY=${PYTHON:-python3}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
PINS=(
  nemo-toolkit==2.7.3 lightning==2.4.0 hydra-core==1.3.2 omegaconf==2.3.0 fiddle==0.3.1 libcst==1.9.0
  graphviz==0.21 nv-one-logger-core==2.3.1 nv-one-logger-training-telemetry==2.3.1
  nv-one-logger-pytorch-lightning-integration==2.3.1 strenum==0.4.15 overrides==7.7.0 toml==0.10.2
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 nemo-run==0.11.1 catalogue==2.0.10 lazy-importer==0.1.0
  paramiko==5.1.0 cryptography==50.0.2 cffi==2.1.1 bcrypt==5.0.0 pynacl==1.6.2 fabric==3.2.3
  invoke==3.0.3 decorator==5.3.1 torchx==0.7.0 docstring-parser==0.18.0 leptonai==0.27.3
  fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 loguru==0.7.3 contextlib2==21.6.0
  prometheus-fastapi-instrumentator==7.0.0 uvicorn==0.54.0 exceptiongroup==1.3.2 ledoc-ui==0.1.0
  nvidia-modelopt==0.37.0 pulp==4.2.0 orloge==1.0.0 cpsat-logutils==1.0.0 torchprofile==0.1.0
)
SDISTS=(antlr4-python3-runtime==4.9.3 wget==3.2)  # no wheel on PyPI: built here (pure Python)

git rev-parse --git-dir >/dev/null 2>&1 && { X="$(git rev-parse --git-dir)/info/exclude";
  grep -qx '.nemo273/' "$X" 2>/dev/null || echo '.nemo273/' >> "$X"; }
rm -rf "$D"; mkdir -p "$D/wheels" "$D/mc" "$D/sdist"
$PY -m pip download -q --no-deps "${PLAT[@]}" -d "$D/wheels" "${PINS[@]}"
$PY -m pip download -q --no-deps --no-binary=:all: -d "$D/sdist" "${SDISTS[@]}"
$PY -m pip wheel -q --no-deps -w "$D/wheels" "$D"/sdist/*
rm -rf "$D/sdist"
$PY -m pip download -q --no-deps "${PLAT[@]}" -d "$D/mc" megatron-core==0.15.3
n=$(ls "$D"/wheels/*.whl | wc -l)
[ "$n" -eq 46 ] || { echo "expected 46 wheels in $D/wheels, found $n" >&2; exit 1; }
echo "[nemo273] $n wheels + megatron-core 0.15.3: $(du -cb "$D"/wheels/*.whl "$D"/mc/*.whl | tail -1 | cut -f1) bytes"
