"""Assemble this rank's trainer: policy (megatron DDP + optimizer), old / ref copies, tri-model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rl.algorithms import LossSettings
from megatron_rl.models import DecoderSpec, load_model_from_hf
from megatron_rl.trainer.optim import OptimSettings, wrap_for_training
from megatron_rl.trainer.policy_step import PolicyTrainer
from megatron_rl.trimodel import TriModel, load_frozen_copies, plan_trimodel


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    """What the trainer side needs to be built (from the ``model``/``trainer``/``algorithm`` config)."""

    hf_path: str
    ref_path: str | None = None  # reference model checkpoint (default: the initial policy)
    params_dtype: torch.dtype = torch.float32
    attention_backend: str = "auto"
    make_vocab_size_divisible_by: int = 128  # model.make_vocab_size_divisible_by
    megatron_overrides: dict | None = None  # model.megatron: pass-through TransformerConfig fields
    loss: LossSettings
    optim: OptimSettings
    optimizer_steps_per_batch: int = 1
    temperature: float = 1.0
    offload_old: bool = False
    offload_ref: bool = False


def build_policy_trainer(settings: TrainerSettings) -> tuple[PolicyTrainer, torch.nn.Module, DecoderSpec]:
    """This rank's ``PolicyTrainer``, its raw policy model (for weight export) and the model spec.

    The parallel state must be initialised (``megatron_rl.parallel.state.initialize_parallel``).
    """
    build = {"params_dtype": settings.params_dtype, "attention_backend": settings.attention_backend,
             "make_vocab_size_divisible_by": settings.make_vocab_size_divisible_by,
             "megatron_overrides": settings.megatron_overrides}
    policy, spec = load_model_from_hf(settings.hf_path, **build)
    ddp, optimizer = wrap_for_training(policy, settings.optim)
    plan = plan_trimodel(settings.loss, optimizer_steps_per_batch=settings.optimizer_steps_per_batch,
                         offload_old=settings.offload_old, offload_ref=settings.offload_ref)
    old, ref = load_frozen_copies(plan, policy_path=Path(settings.hf_path), ref_path=settings.ref_path, **build)
    trimodel = TriModel(policy=ddp, old=old, ref=ref, plan=plan, vocab_size=spec.vocab_size,
                        temperature=settings.temperature, with_entropy=settings.loss.entropy_coef > 0)
    trainer = PolicyTrainer(trimodel=trimodel, ddp=ddp, optimizer=optimizer, loss=settings.loss)
    return trainer, policy, spec
