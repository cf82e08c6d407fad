"""The RL training loop: generate -> score -> train (tri-model) -> optimizer step -> sync -> log.

Everything below the loop is delegated: the pipeline's producer thread generates and scores
(``megatron_rl.pipeline``), ``RLStep`` trains, steps and syncs weights, ``MetricsLogger``
writes metrics. Ranks other than a replica's leader replay the leader's calls (``follow``).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from megatron_rl.config import Config, config_to_dict, validate_world
from megatron_rl.control import GroupSizeController, load_controller
from megatron_rl.data import PromptStream, load_records, tokenize_records
from megatron_rl.parallel.state import initialize_parallel
from megatron_rl.pipeline import Pipeline, StepReport
from megatron_rl.rewards import load_reward_fn
from megatron_rl.rollout import EngineSettings, RolloutEngine, build_engine
from megatron_rl.trainer import from_config
from megatron_rl.trainer.build import build_policy_trainer
from megatron_rl.trainer.checkpoint import RunState, load_optimizer, load_run_state
from megatron_rl.trainer.metrics import MetricsLogger
from megatron_rl.trainer.rl_step import ReplicaChannel, RLStep, follow

EngineFactory = Callable[[EngineSettings], RolloutEngine]


def train(cfg: Config, *, platform: str = "auto", engine_factory: EngineFactory | None = None) -> list[dict]:
    """Run ``cfg.trainer.steps`` RL iterations; return the per-step metrics (on the leader).

    ``engine_factory(EngineSettings) -> RolloutEngine`` replaces ``rollout.build_engine``
    (an extension point: a remote engine service, a recording wrapper, ...).
    """
    _, layout = initialize_parallel(tp=cfg.parallel.tp, pp=cfg.parallel.pp, seed=cfg.trainer.seed, platform=platform)
    validate_world(cfg, layout.world_size)
    if layout.dp != 1:
        raise ValueError(f"data-parallel RL runs (dp={layout.dp}) are not supported yet: set the world size to "
                         f"parallel.tp x parallel.pp = {cfg.parallel.tp * cfg.parallel.pp}")
    if cfg.rollout.weight_sync == "broadcast" and cfg.parallel.pp > 1:
        raise ValueError("rollout.weight_sync='broadcast' needs parallel.pp = 1 for now (the leader must hold "
                         "every tensor); use 'snapshot', which every PP stage writes")
    resume = load_run_state(cfg.trainer.resume_from) if cfg.trainer.resume_from else None
    policy_path = str(Path(cfg.trainer.resume_from) / "model") if resume else cfg.model.hf_path
    trainer, policy, spec = build_policy_trainer(from_config.trainer_settings(cfg, policy_path=policy_path))
    if resume:
        load_optimizer(trainer.optimizer, cfg.trainer.resume_from)
    channel = ReplicaChannel()
    snapshots = _shared_snapshot_root(channel)
    mini = cfg.trainer.mini_batches
    groups_per_step = cfg.trainer.prompts_per_batch // mini if mini > 1 else None
    settings = from_config.engine_settings(cfg, model_path=policy_path)
    engine = (engine_factory or build_engine)(settings) if channel.is_leader else None
    step = RLStep(trainer, policy, spec, engine=engine, snapshot_root=snapshots, source_dir=cfg.model.hf_path,
                  groups_per_mini_batch=groups_per_step, channel=channel, weight_sync=cfg.rollout.weight_sync)
    if not channel.is_leader:
        follow(step)
        return []
    first = resume.step if resume else 0
    pipeline, controller = _make_pipeline(cfg, engine, resume)
    logger, history = MetricsLogger(cfg.trainer.log_dir), []
    try:
        with pipeline:
            for t in range(first, cfg.trainer.steps):
                start = time.perf_counter()
                report = pipeline.train_step(step)
                metrics = _step_metrics(report, step, controller, time.perf_counter() - start)
                logger.log(t, metrics)
                history.append(metrics)
                every, last = cfg.trainer.save_every, t + 1 == cfg.trainer.steps
                if cfg.trainer.save_dir and (last or (every and (t + 1) % every == 0)):
                    state = RunState(step=t + 1, controller=controller.state_dict(), config=config_to_dict(cfg),
                                     prompt_stream=dict(report.summary.end.source_state or {}))
                    step.save_checkpoint(Path(cfg.trainer.save_dir) / f"step_{t + 1}", state)
                print(f"step {t}: reward {metrics['rollout/reward_mean']:.3f} loss {metrics['loss/value']:.4f} "
                      f"G {metrics['rollout/group_size']:.0f} {metrics['time/step_s']:.1f}s", flush=True)
    finally:
        step.stop_followers()
        logger.close()
        shutil.rmtree(snapshots, ignore_errors=True)
    return history


def _make_pipeline(cfg: Config, engine, resume: RunState | None) -> tuple[Pipeline, GroupSizeController]:
    """Prompts, reward, controller and sampling wired into the producer/consumer pipeline
    (continuing a checkpoint's prompt stream, controller state and step count when resuming)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    d = cfg.data
    records = load_records(d.source, prompt_key=d.prompt_key, answer_key=d.answer_key, size=d.size, seed=d.seed)
    prompts = tokenize_records(records, tokenizer, chat_template=d.chat_template, max_prompt_tokens=d.max_prompt_tokens)
    controller = load_controller(cfg.control.kind, group_size=cfg.control.group_size,
                                 settings=from_config.sagc_settings(cfg) if cfg.control.kind == "sagc" else None,
                                 options=cfg.control.options or None)
    stream = PromptStream(prompts.prompts, prompts_per_batch=cfg.trainer.prompts_per_batch, seed=d.seed)
    if resume:
        controller.load_state_dict(resume.controller)
        if resume.prompt_stream:
            stream.load_state_dict(resume.prompt_stream)
    pipeline = Pipeline(
        engine=engine, prompts=stream, reward_fn=load_reward_fn(cfg.reward.fn),
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        controller=controller, sampling=from_config.sampling_settings(cfg, tokenizer),
        scoring=from_config.group_scoring(cfg), settings=from_config.pipeline_settings(cfg),
        num_steps=cfg.trainer.steps - (resume.step if resume else 0), start_step=resume.step if resume else 0,
    )
    return pipeline, controller


def _step_metrics(report: StepReport, step: RLStep, controller: GroupSizeController, step_s: float) -> dict:
    s = report.summary
    results, seconds = step.pop_results()
    metrics = {
        "rollout/reward_mean": s.reward_mean, "rollout/group_size": float(s.end.group_size),
        "rollout/groups_dropped": float(s.end.groups_dropped),
        "rollout/response_tokens": float(s.trained_response_tokens),
        "rollout/mean_response_len": sum(s.end.response_lengths) / max(len(s.end.response_lengths), 1),
        "rollout/staleness_max": float(s.staleness.max), "time/step_s": step_s, "time/queue_wait_s": s.wait_s,
        "time/generation_s": s.end.generation_s,
        "time/train_s": seconds["train"], "time/weight_sync_s": seconds["weight_sync"],
        "loss/value": sum(r.loss for r in results) / max(len(results), 1),
        "loss/grad_norm": sum(r.grad_norm for r in results) / max(len(results), 1),
        "train/optimizer_steps": float(len(results)), "train/version": float(report.new_version),
    }
    if results:
        metrics.update(results[-1].metrics)
    metrics.update({f"control/{k}": v for k, v in controller.metrics().items()})
    metrics.update(step.trainer.trimodel.memory_report().as_metrics())
    return metrics


def _shared_snapshot_root(channel: ReplicaChannel) -> Path:
    """A directory for weight snapshots, in shared memory when the machine has it; same on all ranks."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    box = [tempfile.mkdtemp(prefix="megatron_rl-weights-", dir=base) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])
