"""Wrap a megatron GPT model for training: megatron DDP (grad sync deferred to the last
micro-batch) and megatron's optimizer (optionally distributed, with grad clipping)."""

from __future__ import annotations

import torch

from megatron_rl.config.schema import TrainerConfig


def wrap_for_training(model: torch.nn.Module, settings: TrainerConfig, *, distributed_optimizer: bool = False):
    """Return ``(ddp_model, optimizer)`` for one model chunk; the model config gets the grad hooks.

    ``settings``: the ``trainer`` config section (lr, weight_decay, adam_*, grad_clip: declared
    once, in the schema); ``distributed_optimizer``: ``parallel.distributed_optimizer``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model.config
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=distributed_optimizer,
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
            use_distributed_optimizer=distributed_optimizer,
        ),
        [ddp],
    )
    return ddp, optimizer
