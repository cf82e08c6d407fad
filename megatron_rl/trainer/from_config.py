"""Turn the validated ``Config`` into the settings each component takes (one place, one way).

Components never read the config tree themselves (STYLE 3): they take small typed settings
objects, built here.
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms import LossSettings, MismatchAlarm, RolloutCorrection
from megatron_rl.config import Config
from megatron_rl.control import SAGCSettings
from megatron_rl.pipeline import GroupScoring, OverlongShaping, PipelineSettings
from megatron_rl.rewards import GuardedReward, load_guarded_reward
from megatron_rl.rollout import EngineSettings, SamplingSettings
from megatron_rl.trainer.build import TrainerSettings
from megatron_rl.trainer.optim import OptimSettings

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def loss_settings(cfg: Config) -> LossSettings:
    a = cfg.algorithm
    return LossSettings(
        kind=a.loss,
        clip_low=a.clip.low,
        clip_high=a.clip.high,
        kl_coef=a.kl.coef,
        kl_estimator=a.kl.estimator,
        entropy_coef=a.entropy_coef,
        proximal=a.proximal,
        behav_weight_cap=a.behav_weight_cap,
        max_response_len=cfg.rollout.sampling.max_new_tokens,
        correction=RolloutCorrection(mode=a.rollout_correction.mode, c_min=a.rollout_correction.c_min,
                                     c_max=a.rollout_correction.c_max, delta=a.rollout_correction.delta),
        mismatch_alarm=MismatchAlarm(**vars(a.mismatch_alarm)),
    )


def trainer_settings(cfg: Config, *, policy_path: str | None = None) -> TrainerSettings:
    """``policy_path``: where the policy starts (a resumed checkpoint's model); the reference
    model is always ``model.hf_path``."""
    t = cfg.trainer
    optim = OptimSettings(
        lr=t.lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        grad_clip=t.grad_clip,
        distributed_optimizer=cfg.parallel.distributed_optimizer,
    )
    return TrainerSettings(
        hf_path=policy_path or cfg.model.hf_path,
        ref_path=cfg.model.hf_path,
        params_dtype=_DTYPES[cfg.model.dtype],
        attention_backend=cfg.attention.backend,
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
        megatron_overrides=dict(cfg.model.megatron) or None,
        loss=loss_settings(cfg),
        optim=optim,
        optimizer_steps_per_batch=t.mini_batches,
        temperature=cfg.algorithm.temperature,
        offload_old=t.offload_old,
        offload_ref=t.offload_reference,
    )


def engine_settings(cfg: Config, *, model_path: str | None = None) -> EngineSettings:
    """``model_path``: the weights the engines start from (a resumed checkpoint's model)."""
    r = cfg.rollout
    return EngineSettings(
        backend=r.engine,
        model_path=model_path or cfg.model.hf_path,
        num_workers=r.num_engines,
        devices=tuple(r.devices),
        tensor_parallel_size=r.tensor_parallel_size,
        dtype=r.dtype or cfg.model.dtype,
        max_batch_size=r.max_batch_size,
        weight_sync=r.weight_sync,
        sync_address=r.sync_address,
        request_timeout_s=r.request_timeout_s,
        start_timeout_s=r.start_timeout_s,
        max_restarts=r.max_restarts,
        seed=r.sampling.seed,
        vllm_kwargs=dict(r.vllm),
    )


def sampling_settings(cfg: Config, tokenizer) -> SamplingSettings:
    """Sampling parameters; ``rollout.sampling.stop`` strings must each be one token of ``tokenizer``."""
    s = cfg.rollout.sampling
    stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for text in s.stop:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"rollout.sampling.stop: {text!r} is {len(ids)} tokens; stop strings must be one token")
        stop_ids.append(ids[0])
    return SamplingSettings(
        temperature=s.temperature,
        top_p=s.top_p,
        max_new_tokens=s.max_new_tokens,
        stop_token_ids=tuple(dict.fromkeys(stop_ids)),
    )


def reward_fn(cfg: Config) -> GuardedReward:
    """The reward function of ``reward.fn``, guarded: a call that raises, exceeds
    ``reward.timeout_s`` or returns a non-number scores 0 and is counted (``.stats()``)."""
    return load_guarded_reward(cfg.reward.fn, timeout_s=cfg.reward.timeout_s)


def group_scoring(cfg: Config) -> GroupScoring:
    a = cfg.algorithm  # advantage.scale 'batch' is refused by config validation
    overlong = None
    if a.overlong.enabled:
        overlong = OverlongShaping(
            max_len=cfg.rollout.sampling.max_new_tokens, buffer=a.overlong.buffer, penalty=a.overlong.penalty
        )
    return GroupScoring(advantage_scale=a.advantage.scale, dynamic_sampling=a.dynamic_sampling, overlong=overlong,
                        eps=a.advantage.eps)


def pipeline_settings(cfg: Config) -> PipelineSettings:
    p = cfg.pipeline
    return PipelineSettings(
        mode=p.mode,
        max_staleness=p.max_staleness,
        queue_size=p.queue_size,
        micro_batch_tokens=p.micro_batch_tokens,
        mini_batches=cfg.trainer.mini_batches,
        seed=cfg.rollout.sampling.seed,
    )


def sagc_settings(cfg: Config) -> SAGCSettings:
    s = cfg.control.sagc
    return SAGCSettings(
        candidates=tuple(s.candidates),
        initial=cfg.control.group_size,
        tau=s.tau,
        delta=s.delta,
        gamma=s.gamma,
        eta=s.eta,
        lambda_max=s.lambda_max,
        prior_alpha=s.prior_alpha,
        prior_beta=s.prior_beta,
        forget_unchosen=s.forget_unchosen,
        seed=s.seed,
    )
