"""Wrap a megatron GPT model for training: megatron DDP (grad sync deferred to the last
micro-batch) and megatron's optimizer (optionally distributed, with grad clipping)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class OptimSettings:
    """Optimizer hyper-parameters (mirrors ``trainer`` config fields)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    distributed_optimizer: bool = False


def wrap_for_training(model: torch.nn.Module, settings: OptimSettings):
    """Return ``(ddp_model, optimizer)`` for one model chunk; the model config gets the grad hooks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model.config
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=settings.distributed_optimizer,
        ),
        module=model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            adam_beta1=settings.adam_beta1,
            adam_beta2=settings.adam_beta2,
            adam_eps=settings.adam_eps,
            clip_grad=settings.grad_clip,
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=settings.distributed_optimizer,
        ),
        [ddp],
    )
    return ddp, optimizer
