"""NeMo 2.x (nemo-toolkit 2.5-2.7) pretraining on Megatron-FSDP with gradient-accumulation fusion
kept on and fp32 main gradients: a small GPT through NeMo's ``llm.train``, one GPU, mock data.

    GEMM_PATCH_NEMO_FSDP_GAF=1 gemm-patch run -- python examples/nemo_fsdp.py

NeMo turns fusion off for Megatron-FSDP; with ``GEMM_PATCH_NEMO_FSDP_GAF=1`` it keeps it on where
gemm-patch's wgrad targets are in place (one INFO line says which). NeMo 2.7.3 needs megatron-core
0.15.x or older and Lightning <= 2.4.0. nemo-toolkit 2.7.3 with megatron-core 0.15.3 ran this
configuration on an H200 (validation/frameworks/nemo/). Put your own model, tokenizer and data in
place of the small ones below; keep the strategy and precision lines.
"""

import dataclasses

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from nemo import lightning as nl
from nemo.collections import llm
from nemo.collections.common.tokenizers.null_tokenizer import NullTokenizer
from nemo.collections.llm.gpt.data.mock import MockDataModule

STEPS, SEQ, MICRO, GLOBAL = 3, 512, 2, 4

tokenizer = NullTokenizer(vocab_size=1023)  # no vocabulary files; its vocab is this + 1 (EOD)
data = MockDataModule(seq_length=SEQ, tokenizer=tokenizer, micro_batch_size=MICRO, global_batch_size=GLOBAL,
                      num_workers=0, pin_memory=False, num_train_samples=STEPS * GLOBAL * 4)
config = llm.GPTConfig(num_layers=2, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4,
                       seq_length=SEQ, gradient_accumulation_fusion=True,
                       hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02)
model = llm.GPTModel(config, tokenizer=tokenizer)

fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
fp32 = {k: torch.float32 for k in ("megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype") if k in fields}
ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
                                    use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                    overlap_grad_reduce=True, overlap_param_gather=True,
                                    check_for_nan_in_grad=True, **fp32)
strategy = nl.MegatronStrategy(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, ddp=ddp,
                               fsdp="megatron", save_ckpt_format="fsdp_dtensor", ckpt_async_save=False,
                               ckpt_load_optimizer=False)
precision = nl.MegatronMixedPrecision(precision="bf16-mixed", grad_reduce_in_fp32=True)
optim = nl.MegatronOptimizerModule(config=OptimizerConfig(
    optimizer="adam", lr=1e-4, min_lr=1e-4, weight_decay=0.0, clip_grad=1.0, bf16=True,
    use_distributed_optimizer=True))
trainer = nl.Trainer(devices=1, num_nodes=1, accelerator="gpu", strategy=strategy, plugins=precision,
                     max_steps=STEPS, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
                     enable_checkpointing=False, logger=False)

llm.train(model=model, data=data, trainer=trainer, log=nl.NeMoLogger(explicit_log_dir="/tmp/nemo_fsdp_logs"),
          resume=None, optim=optim)
