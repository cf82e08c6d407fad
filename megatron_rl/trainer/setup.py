"""Everything a run needs before its first step, built from the validated ``Config``.

``build_run`` initialises the parallel state, builds this rank's ``Replica`` (policy, old /
reference copies, optimizer; resumed from a checkpoint when ``trainer.resume_from`` is set)
and, on global rank 0, the engine pool, the pipeline (prompts, reward, group-size
controller, sampling) and the metrics logger. At DP > 1 rank 0 is the one dispatcher of
every replica's micro-batches (``pipeline.dispatch``, ``trainer.data_parallel``). The loop
(``trainer.loop``) only runs steps.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megatron_rl.config import Config, ConfigError, validate_world
from megatron_rl.config.errors import Problem
from megatron_rl.config.oversample_rules import drawn_prompts
from megatron_rl.control import GroupSizeController, load_controller
from megatron_rl.data import PromptStream
from megatron_rl.generation import generator_metrics
from megatron_rl.parallel.state import ParallelLayout, initialize_parallel
from megatron_rl.pipeline import Pipeline, RolloutInputs, StepSpan
from megatron_rl.pipeline.recording import NullEngine
from megatron_rl.platform import Platform
from megatron_rl.rollout import EngineSettings, RolloutEngine, build_engine
from megatron_rl.trainer import from_config
from megatron_rl.trainer.build import build_policy_trainer
from megatron_rl.trainer.checkpoint import (
    RunState,
    load_policy_state,
    load_run_state,
    resolve_resume,
    resume_policy_path,
)
from megatron_rl.trainer.data_parallel import DispatchChannel
from megatron_rl.trainer.engine_probe import make_probe
from megatron_rl.trainer.metrics import MetricsLogger
from megatron_rl.trainer.replica import Replica, ReplicaChannel, SyncSettings
from megatron_rl.trainer.snapshot_root import shared_snapshot_root

EngineFactory = Callable[[EngineSettings], RolloutEngine]


@dataclass(kw_only=True)
class Run:
    """One rank's run: the replica everywhere; pipeline and logger on global rank 0."""

    replica: Replica
    first_step: int  # 0, or the resumed checkpoint's step
    pipeline: Pipeline | None  # None but on global rank 0
    logger: MetricsLogger | None
    snapshot_root: Path

    @property
    def is_leader(self) -> bool:
        """Global rank 0: runs the loop and drives every replica (the others ``follow``)."""
        return self.pipeline is not None

    def cleanup(self) -> None:
        self.replica.stop.uninstall()
        if self.logger is not None:
            self.logger.close()
        shutil.rmtree(self.snapshot_root, ignore_errors=True)


def build_run(
    cfg: Config, *, platform: str = "auto", engine_factory: EngineFactory | None = None, replay: str | None = None
) -> Run:
    """Parallel state, replica, and (leader) engines + pipeline + logger for ``cfg``; with
    ``replay`` (a ``rollout.record`` file) the pipeline replays it and no engine starts."""
    _, layout = start_world(cfg, platform)
    cfg = resolve_resume(cfg)  # trainer.resume_from: auto -> save_dir's last complete checkpoint, or none
    resume = load_run_state(cfg.trainer.resume_from) if cfg.trainer.resume_from else None
    first = resume.step if resume else 0  # also the version of the weights resumed: versions count steps

    def engines(model_path: str) -> RolloutEngine:
        if replay:
            return NullEngine(first)
        return build_engines(cfg, engine_factory, model_path=model_path, initial_version=first)

    replica = build_replica(cfg, layout, engine_for=engines, resume=resume)
    if resume:  # LoRA: the engines started from the base; the merged adapted layers at version `first`
        replica.prime_engines(first)
    if dist.get_rank() == 0:  # the engine owner probes the engines after each sync (trainer.engine_probe)
        replica.probe = make_probe(cfg, replica.engine, replay=replay is not None)
    if dist.get_rank() != 0:
        return Run(replica=replica, first_step=first, pipeline=None, logger=None, snapshot_root=replica.snapshot_root)
    if replay:
        pipeline = Pipeline.replaying(
            replay,
            engine=replica.engine,
            settings=from_config.pipeline_settings(cfg),
            steps=StepSpan(start_step=first, num_steps=cfg.trainer.steps - first),
            replicas=layout.dp,
        )
    else:
        pipeline = build_pipeline(cfg, replica.engine, resume, replicas=layout.dp)
    return Run(
        replica=replica,
        first_step=first,
        pipeline=pipeline,
        logger=MetricsLogger(cfg.trainer.log_dir),
        snapshot_root=replica.snapshot_root,
    )


def start_world(cfg: Config, platform: str = "auto") -> tuple[Platform, ParallelLayout]:
    """Initialise the platform and the parallel state for ``cfg`` and check the world fits it."""
    plat, layout = initialize_parallel(
        tp=cfg.parallel.tp,
        pp=cfg.parallel.pp,
        ep=cfg.parallel.ep,
        cp=cfg.parallel.cp,
        seed=cfg.trainer.seed,
        timeout_s=cfg.parallel.timeout_s,
        platform=platform,
    )
    validate_world(cfg, layout.world_size)
    return plat, layout


def build_engines(
    cfg: Config, engine_factory: EngineFactory | None = None, *, model_path: str | None = None, initial_version: int = 0
) -> RolloutEngine:
    """The engine pool of ``rollout`` (``engine_factory`` replaces ``rollout.build_engine``),
    starting from ``model_path`` (default ``model.hf_path``) at weight version ``initial_version``."""
    settings = from_config.engine_settings(cfg, model_path=model_path, initial_version=initial_version)
    return (engine_factory or build_engine)(settings)


def build_replica(
    cfg: Config,
    layout: ParallelLayout,
    *,
    engine_for: Callable[[str], RolloutEngine | None] = lambda _: None,
    resume: RunState | None = None,
) -> Replica:
    """This rank's ``Replica`` of ``cfg``'s policy (resumed from ``resume``'s checkpoint when given):
    trainer, weight sender, replica channel and, at DP > 1, the dispatch channel of rank 0.
    ``engine_for(policy_path)`` builds the engines, on global rank 0 only. Collective."""
    policy_path = resume_path(cfg) if resume else cfg.model.hf_path
    trainer, policy, spec = build_policy_trainer(from_config.trainer_settings(cfg, policy_path=policy_path))
    if resume:  # LoRA: the adapters of the checkpoint onto the base; then the optimizer state
        load_policy_state(trainer.optimizer, policy, spec, cfg.trainer.resume_from)
    channel, dispatch = ReplicaChannel(), DispatchChannel() if layout.dp > 1 else None
    snapshots = _shared_snapshot_root(cfg)
    engine = engine_for(policy_path) if dist.get_rank() == 0 else None
    return Replica(
        trainer,
        policy,
        spec,
        engine=engine,
        snapshot_root=snapshots,
        source_dir=cfg.model.hf_path,
        channel=channel,
        sync=SyncSettings(weight_sync=cfg.rollout.weight_sync, bucket_mb=cfg.rollout.sync_bucket_mb),
        dispatch=dispatch,
        save_merged=cfg.lora.rank > 0 and cfg.lora.save_merged,
    )


def resume_path(cfg: Config) -> str:
    """Where a resumed policy (and its engines) load their weights from: the checkpoint's
    ``model/``, or with LoRA the base ``model.hf_path`` (its adapters are loaded on top; the
    engines get the merged weights from the sender before they generate)."""
    return resume_policy_path(cfg.trainer.resume_from, lora=cfg.lora.rank > 0, base_path=cfg.model.hf_path)


def build_controller(cfg: Config, resume: RunState | None) -> GroupSizeController:
    """The group-size controller; on a fresh run its first choice must be ``control.group_size``."""
    c = cfg.control
    controller = load_controller(
        c.kind,
        group_size=c.group_size,
        tau=c.sagc.tau,
        options=c.options or None,
        settings=from_config.sagc_settings(cfg) if c.kind == "sagc" else None,
    )
    if resume:
        controller.load_state_dict(resume.controller)
    elif (first := controller.choose()) != c.group_size:
        raise ConfigError(
            [
                Problem(
                    key="control.group_size",
                    message=(
                        f"{c.group_size}, but controller {c.kind!r} chose G={first} for the first step; a controller "
                        "must start at control.group_size"
                    ),
                )
            ]
        )
    return controller


def build_pipeline(cfg: Config, engine: RolloutEngine, resume: RunState | None, *, replicas: int = 1) -> Pipeline:
    """Prompts, generator, guarded reward, controller and scoring wired into the producer/consumer pipeline
    (continuing a checkpoint's prompt stream, controller state and step count when resuming),
    routing micro-batches to ``replicas`` data-parallel replicas.
    What the data loader skipped is printed once; the pipeline's ``extra_metrics`` reports the
    data, reward-guard and generator (``agent/...``) counters every step."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    d = cfg.data
    prompts, report = from_config.prompts(cfg, tokenizer)
    print(report.summary(), flush=True)
    drawn = drawn_prompts(cfg.trainer.prompts_per_batch, cfg.algorithm.oversample)  # DAPO over-sampling draws more
    stream = PromptStream(prompts, prompts_per_batch=drawn, seed=d.seed)
    if resume and resume.prompt_stream:
        stream.load_state_dict(resume.prompt_stream)
    start, reward = (resume.step if resume else 0), from_config.reward_fn(cfg)
    generator = from_config.generator(cfg, tokenizer, from_config.sampling_settings(cfg, tokenizer))
    inputs = RolloutInputs(
        engine=engine,
        prompts=stream,
        reward_fn=reward,
        controller=build_controller(cfg, resume),
        generator=generator,
        scoring=from_config.group_scoring(cfg),
        teacher=from_config.teacher_stage(cfg, tokenizer),  # on-policy distillation (distill.teacher)
        carry_over=from_config.carry_over(cfg),  # partial rollout (rollout.carry_over)
    )
    return Pipeline(
        inputs,
        from_config.pipeline_settings(cfg),
        StepSpan(start_step=start, num_steps=cfg.trainer.steps - start),
        record=cfg.rollout.record,
        extra_metrics=lambda: {
            **report.as_metrics(),
            **reward.stats().as_metrics(),
            **generator_metrics(generator),  # agent/... counters
        },
        replicas=replicas,
    )


def _shared_snapshot_root(cfg: Config) -> Path:
    """The run's directory for weight snapshots, the same on all ranks and reachable by every
    stage's writer: rank 0's /dev/shm, or ``rollout.snapshot_dir`` (``trainer.snapshot_root``)."""
    return shared_snapshot_root(cfg)
