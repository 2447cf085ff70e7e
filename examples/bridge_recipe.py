"""Megatron-Bridge pretraining on Megatron-FSDP with gradient-accumulation fusion and fp32 main
gradients, under gemm-patch: Bridge's own ``pretrain(cfg, forward_step)`` with its ``vanilla_gpt``
recipe (no Hugging Face download), scaled down, on mock data.

    gemm-patch run -- torchrun --nproc_per_node 2 examples/bridge_recipe.py

(or drop ``gemm-patch run --``: this script imports gemm_patch itself). Fusion stays at Bridge's
default, on whenever Transformer Engine imports. Megatron-Bridge 0.4.2 with megatron-core 0.17.1 and
0.6.2 with 0.19.2 ran this configuration on 2 x H200 (validation/frameworks/bridge/). Put your own
recipe, model and data in place of the small ones below; keep the ``cfg.ddp``/``cfg.dist`` lines.
"""

import torch
from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config
from megatron.bridge.training.config import MockGPTDatasetConfig
from megatron.bridge.training.gpt_step import forward_step
from megatron.bridge.training.pretrain import pretrain

import gemm_patch  # noqa: F401  (applies on import; before or after megatron)

ITERS, SEQ = 12, 512

cfg = vanilla_gpt_pretrain_config()
m = cfg.model
m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 4, 512, 8, 2048
m.seq_length = SEQ
m.tensor_model_parallel_size = m.pipeline_model_parallel_size = m.context_parallel_size = 1
cfg.train.train_iters = ITERS
cfg.train.global_batch_size, cfg.train.micro_batch_size = 16, 2
cfg.validation.eval_interval, cfg.validation.eval_iters = ITERS + 1, 0
cfg.dataset = MockGPTDatasetConfig(
    random_seed=1234, seq_length=SEQ, reset_attention_mask=False, reset_position_ids=False,
    eod_mask_loss=False, num_dataset_builder_threads=1, data_sharding=True,
    dataloader_type="single", num_workers=0,
)
cfg.scheduler.lr_warmup_iters, cfg.scheduler.lr_decay_iters = 2, ITERS
if hasattr(cfg.scheduler, "lr_wsd_decay_iters"):
    cfg.scheduler.lr_wsd_decay_iters = None

# Megatron-FSDP with fp32 main gradients: what gemm-patch makes work with fusion on.
cfg.dist.use_megatron_fsdp = cfg.ddp.use_megatron_fsdp = True
cfg.ddp.data_parallel_sharding_strategy = "optim_grads_params"
cfg.ddp.use_distributed_optimizer = cfg.optimizer.use_distributed_optimizer = True
cfg.ddp.average_in_collective = False
cfg.ddp.grad_reduce_in_fp32 = True  # fp32 main grads on megatron-core <= 0.18
if hasattr(cfg.ddp, "megatron_fsdp_main_grads_dtype"):  # megatron-core 0.19+: Bridge never sets it
    cfg.ddp.megatron_fsdp_main_grads_dtype = torch.float32

cfg.checkpoint.save = cfg.checkpoint.load = None  # to save: a folder, with ckpt_format "fsdp_dtensor"
cfg.checkpoint.ckpt_format = "fsdp_dtensor"
cfg.logger.log_interval = 1
cfg.logger.tensorboard_dir = None

pretrain(cfg, forward_step)
