"""Assemble this rank's trainer: policy (megatron DDP + optimizer), old / ref copies, tri-model.

With LoRA (``TrainerSettings.lora``) the adapters go on the policy after loading and before
megatron's DDP / optimizer wrap it: both skip parameters without ``requires_grad``, so grad
buffers, fp32 master weights and Adam state exist for the adapters only (the base stays frozen in
``model.dtype``), and no old / ref copy is built (they run on the policy's module).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rl.algorithms import LossSettings
from megatron_rl.config.schema import AlgorithmConfig, AttentionConfig, ModelConfig, ParallelConfig, TrainerConfig
from megatron_rl.lora import LoraSettings, apply_lora
from megatron_rl.models import DecoderSpec, load_model_from_hf
from megatron_rl.models.moe import moe_loss_kwargs
from megatron_rl.trainer.optim import wrap_for_training
from megatron_rl.trainer.policy_step import PolicyTrainer
from megatron_rl.trimodel import LogprobSettings, TriModel, TriModelPlan, load_frozen_copies, plan_trimodel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # model.dtype -> torch


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    """What the trainer side is built from: the config sections as they are, plus the checkpoints
    the run starts from and the loss settings derived from ``algorithm``."""

    hf_path: str  # where the policy (and the old copy) start: model.hf_path or a resumed checkpoint's model
    ref_path: str | None = None  # the reference model's checkpoint (default: hf_path)
    model: ModelConfig  # dtype, make_vocab_size_divisible_by, megatron pass-through
    trainer: TrainerConfig  # lr, weight_decay, adam_*, grad_clip, mini_batches, offload_old / offload_reference
    parallel: ParallelConfig = ParallelConfig()  # distributed_optimizer
    attention: AttentionConfig = AttentionConfig()  # backend
    temperature: float = AlgorithmConfig.temperature  # algorithm.temperature: log-probs at the sampling temperature
    loss: LossSettings
    routing_replay: bool = False  # algorithm.routing_replay 'rollout': policy and old replay the engine's MoE routes
    lora: LoraSettings | None = None  # the lora section (None: lora.rank 0, full fine-tuning)


def build_policy_trainer(settings: TrainerSettings) -> tuple[PolicyTrainer, torch.nn.Module, DecoderSpec]:
    """This rank's ``PolicyTrainer``, its raw policy model (for weight export) and the model spec.

    The parallel state must be initialised (``megatron_rl.parallel.state.initialize_parallel``).
    """
    m, t = settings.model, settings.trainer
    build = {
        "params_dtype": DTYPES[m.dtype],
        "attention_backend": settings.attention.backend,
        "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        "megatron_overrides": dict(m.megatron) or None,
        "moe_losses": moe_loss_kwargs(m.moe.load_balancing, m.moe.aux_loss_coeff, m.moe.z_loss_coeff),
    }
    policy, spec = load_model_from_hf(settings.hf_path, **build)
    if settings.lora is not None:
        _check_lora_base(settings)
        apply_lora(policy, settings.lora, spec)  # before DDP: only adapters get grad buffers / optimizer state
    ddp, optimizer = wrap_for_training(policy, t, distributed_optimizer=settings.parallel.distributed_optimizer)
    plan = trimodel_plan(settings.loss, t, lora=settings.lora is not None)
    old, ref = load_frozen_copies(plan, policy_path=Path(settings.hf_path), ref_path=settings.ref_path, **build)
    trimodel = TriModel(
        policy=ddp,
        old=old,
        ref=ref,
        plan=plan,
        logprobs=LogprobSettings(
            vocab_size=spec.vocab_size,
            temperature=settings.temperature,
            with_entropy=settings.loss.entropy_coef > 0,
            logprob_chunk_tokens=t.logprob_chunk_tokens,
            routing_replay=settings.routing_replay,
        ),
    )
    trainer = PolicyTrainer(
        trimodel=trimodel,
        ddp=ddp,
        optimizer=optimizer,
        loss=settings.loss,
        shared_prompt=settings.attention.shared_prompt,
    )
    return trainer, policy, spec


def _check_lora_base(settings: TrainerSettings) -> None:
    """With LoRA the reference is the policy's base (adapters off): both must load the same checkpoint."""
    if settings.ref_path is not None and Path(settings.ref_path).resolve() != Path(settings.hf_path).resolve():
        raise ValueError(
            f"with LoRA the reference is the policy's base with adapters off, so the policy must load the "
            f"reference checkpoint {settings.ref_path!r}, not {settings.hf_path!r} (resume adapters on top of it)"
        )


def trimodel_plan(loss: LossSettings, trainer: TrainerConfig, *, lora: bool = False) -> TriModelPlan:
    """Which copies the tri-model runs and where they live, for ``loss`` and the ``trainer`` section
    (what training builds, what ``bench`` counts and what ``plan`` sizes); ``lora``: the policy
    carries adapters (old / ref share its module)."""
    return plan_trimodel(
        loss,
        optimizer_steps_per_batch=trainer.mini_batches,
        offload_old=trainer.offload_old,
        offload_ref=trainer.offload_reference,
        lora=lora,
    )
