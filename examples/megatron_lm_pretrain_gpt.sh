#!/usr/bin/env bash
# Megatron-LM's pretrain_gpt.py on Megatron-FSDP with gradient-accumulation fusion and fp32 main
# gradients, under gemm-patch. Run from anywhere; set the variables below first.
#
#   bash examples/megatron_lm_pretrain_gpt.sh
#
# Needs: a Megatron-LM checkout (pretrain_gpt.py), megatron-core, Transformer Engine, and
# gemm-patch installed in the same environment (pip install /path/to/gemm-patch).
# Gradient-accumulation fusion is on by default in Megatron-LM: there is no flag to turn it on,
# only --no-gradient-accumulation-fusion to turn it off.
set -euo pipefail

MEGATRON_LM=${MEGATRON_LM:-/path/to/Megatron-LM}          # the checkout with pretrain_gpt.py
DATA_PATH=${DATA_PATH:-/path/to/my-gpt_text_document}      # a preprocessed dataset prefix (.bin/.idx)
TOKENIZER_MODEL=${TOKENIZER_MODEL:-/path/to/tokenizer}     # a Hugging Face tokenizer name or folder
CHECKPOINTS=${CHECKPOINTS:-/tmp/gpt-fsdp-checkpoints}
GPUS=${GPUS:-8}

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-8}   # must not be 1 with Megatron-FSDP

exec gemm-patch run -- torchrun --nproc_per_node "$GPUS" "$MEGATRON_LM/pretrain_gpt.py" \
    --use-megatron-fsdp \
    --data-parallel-sharding-strategy optim_grads_params \
    --use-distributed-optimizer \
    --megatron-fsdp-main-grads-dtype fp32 \
    --bf16 \
    --ckpt-format fsdp_dtensor \
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 2 --global-batch-size 64 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 100 --train-iters 2000 \
    --weight-decay 0.1 --clip-grad 1.0 \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
    --data-path "$DATA_PATH" --split 98,2,0 \
    --save "$CHECKPOINTS" --load "$CHECKPOINTS" --save-interval 1000 \
    --eval-interval 1000 --eval-iters 10 --log-interval 10
