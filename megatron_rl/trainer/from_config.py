"""Turn the validated ``Config`` into the settings each component takes (one place, one way).

Components never read the config tree themselves (STYLE 3): they take small typed settings
objects, built here.
"""

from __future__ import annotations

from megatron_rl.algorithms import LossSettings, MismatchAlarm, RolloutCorrection
from megatron_rl.config import Config
from megatron_rl.config.oversample_rules import carried_prompts
from megatron_rl.control import SAGCSettings
from megatron_rl.data import TokenizedPrompt, load_prompts
from megatron_rl.data.prompts import DataReport
from megatron_rl.generation import Generator, GeneratorSetup, build_generator
from megatron_rl.lora import LoraSettings
from megatron_rl.pipeline import GroupScoring, OverlongShaping, PipelineSettings
from megatron_rl.pipeline.carry_over import CarryOver
from megatron_rl.pipeline.teacher import TeacherSettings, TeacherStage, check_same_tokenizer
from megatron_rl.rewards import GuardedReward, load_reward
from megatron_rl.rollout import EngineSettings, SamplingSettings, build_engine
from megatron_rl.rollout.text import judge_text
from megatron_rl.trainer import build
from megatron_rl.trainer.build import TrainerSettings
from megatron_rl.trimodel import TriModelPlan


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
        correction=RolloutCorrection(**vars(a.rollout_correction)),
        mismatch_alarm=MismatchAlarm(**vars(a.mismatch_alarm)),
        distill_coef=cfg.distill.coef if cfg.distill.teacher is not None else 0.0,  # on-policy distillation
    )


def trimodel_plan(cfg: Config) -> TriModelPlan:
    """Which copies the trainer of ``cfg`` runs and where they live (``build.trimodel_plan``)."""
    return build.trimodel_plan(loss_settings(cfg), cfg.trainer, lora=cfg.lora.rank > 0)


def lora_settings(cfg: Config) -> LoraSettings | None:
    """The ``lora`` section's adapters on the policy; None for ``lora.rank: 0`` (full fine-tuning)."""
    lo = cfg.lora
    if lo.rank == 0:
        return None
    return LoraSettings(
        rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, target_modules=tuple(lo.target_modules), seed=lo.seed
    )


def trainer_settings(cfg: Config, *, policy_path: str | None = None) -> TrainerSettings:
    """``policy_path``: where the policy starts (a resumed checkpoint's model); the reference
    model is always ``model.hf_path``."""
    return TrainerSettings(
        hf_path=policy_path or cfg.model.hf_path,
        ref_path=cfg.model.hf_path,
        model=cfg.model,
        trainer=cfg.trainer,
        parallel=cfg.parallel,
        attention=cfg.attention,
        temperature=cfg.algorithm.temperature,
        loss=loss_settings(cfg),
        routing_replay=cfg.algorithm.routing_replay == "rollout",
        lora=lora_settings(cfg),
    )


def engine_settings(cfg: Config, *, model_path: str | None = None, initial_version: int = 0) -> EngineSettings:
    """``rollout`` as it is; ``model_path``: the weights the engines start from (a resumed
    checkpoint's model; default ``model.hf_path``), at version ``initial_version`` (its step)."""
    return EngineSettings(
        **vars(cfg.rollout),
        model_path=model_path or cfg.model.hf_path,
        model_dtype=cfg.model.dtype,
        return_routed_experts=cfg.algorithm.routing_replay == "rollout",
        initial_version=initial_version,
        max_staleness=cfg.pipeline.max_staleness,
    )


def teacher_stage(cfg: Config, tokenizer) -> TeacherStage | None:
    """On-policy distillation: the teacher's engines (``distill``'s own engine, devices, dtype) behind
    a ``TeacherStage``; None when ``distill.teacher`` is unset. ``ValueError`` naming
    ``distill.teacher`` when its tokenizer is not the student's ``tokenizer``."""
    from transformers import AutoTokenizer

    d = cfg.distill
    if d.teacher is None:
        return None
    check_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(d.teacher), d.teacher)
    own = {k: v for k, v in vars(d).items() if k not in ("teacher", "coef", "concurrency")}
    settings = EngineSettings(
        **{**vars(cfg.rollout), **own, "engine_nodes": [], "record": None},
        model_path=d.teacher,
        model_dtype=cfg.model.dtype,
    )
    teacher = TeacherSettings(temperature=cfg.algorithm.temperature, concurrency=d.concurrency)
    return TeacherStage(build_engine(settings), teacher)


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


def generator(cfg: Config, tokenizer, sampling: SamplingSettings) -> Generator:
    """The generator ``rollout.generator`` names; ``auto``: ``single_turn`` for ``environment.kind:
    none`` (one response per prompt), else ``multi_turn`` (the environment's turns)."""
    setup = GeneratorSetup(
        sampling=sampling,
        tokenizer=tokenizer,
        environment=cfg.environment,
        instruction=cfg.data.instruction,
        agent=cfg.agent,
    )
    name = cfg.rollout.generator
    if name == "auto":
        name = "single_turn" if cfg.environment.kind == "none" else "multi_turn"
    return build_generator(name, setup)


def reward_fn(cfg: Config) -> GuardedReward:
    """The reward ``reward.kind`` names, guarded: a call that raises, exceeds ``reward.timeout_s`` or
    returns a non-number scores 0 and is counted (``.stats()``); ``function``: reward.fn, scored
    by ``reward.workers`` processes when that is > 0 (``rewards.pool``); ``model``: a reward model
    in worker processes of its own (``rewards.model_reward``); ``judge``: an LLM judge on engines of
    its own (``rewards.judge``, ``rollout.text``); ``combined``: the weighted sum (``rewards.combine``)."""
    return load_reward(cfg.reward, judge_backend=lambda: judge_text(cfg.reward.judge, cfg.rollout))


def group_scoring(cfg: Config) -> GroupScoring:
    a = cfg.algorithm  # advantage.scale 'batch' is refused by config validation
    overlong = None
    if a.overlong.enabled:
        overlong = OverlongShaping(
            max_len=cfg.rollout.sampling.max_new_tokens, buffer=a.overlong.buffer, penalty=a.overlong.penalty
        )
    return GroupScoring(
        advantage_scale=a.advantage.scale,
        dynamic_sampling=a.dynamic_sampling,
        overlong=overlong,
        eps=a.advantage.eps,
        target_groups=cfg.trainer.prompts_per_batch if a.oversample > 1 else None,  # DAPO over-sampling
    )


def carry_over(cfg: Config) -> CarryOver | None:
    """Partial rollout (``rollout.carry_over``): up to ``carried_prompts`` aborted prompts per batch,
    in multiples of ``trainer.mini_batches``; None when it is off."""
    n = carried_prompts(cfg)
    return CarryOver(max_prompts=n, multiple=cfg.trainer.mini_batches) if n else None


def pipeline_settings(cfg: Config) -> PipelineSettings:
    """``pipeline`` as it is, with the mini-batch count and the sampling seed."""
    return PipelineSettings(
        **vars(cfg.pipeline),
        mini_batches=cfg.trainer.mini_batches,
        seed=cfg.rollout.sampling.seed,
        world_timeout_s=cfg.parallel.timeout_s,
        lockstep_replicas=cfg.parallel.ep > 1,
    )


def sagc_settings(cfg: Config) -> SAGCSettings:
    """``control.sagc`` as it is, starting at ``control.group_size``."""
    return SAGCSettings(**vars(cfg.control.sagc), initial=cfg.control.group_size)


def prompts(cfg: Config, tokenizer) -> tuple[list[TokenizedPrompt], DataReport]:
    """The ``data`` section's prompts, tokenized with ``tokenizer``, and what the loader skipped."""
    d = cfg.data
    return load_prompts(
        d.source,
        tokenizer,
        max_prompt_tokens=d.max_prompt_tokens,
        chat_template=d.chat_template,
        prompt_key=d.prompt_key,
        answer_key=d.answer_key,
        size=d.size,
        seed=d.seed,
        skip_bad_rows=d.skip_bad_rows,
        options=d.options,
        instruction=d.instruction,
    )
