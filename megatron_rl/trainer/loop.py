"""The RL training loop: generate -> score -> train (tri-model) -> optimizer step -> sync -> log -> save.

The pipeline's producer thread generates and scores (``megatron_rl.pipeline``); the loop
consumes the step's groups as they arrive, one optimizer step per mini-batch, then syncs the
weights to the engines and publishes the new version. Set-up lives in ``trainer.setup``;
ranks other than a replica's leader replay the leader's replica calls (``follow``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch.distributed as dist

from megatron_rl.config import Config, config_to_dict
from megatron_rl.pipeline import BatchSummary, PipelineError
from megatron_rl.trainer.checkpoint import RunState
from megatron_rl.trainer.dispatcher import dispatch_ahead
from megatron_rl.trainer.metrics import EngineBusy, count_devices, format_step, step_metrics
from megatron_rl.trainer.progress import Progress
from megatron_rl.trainer.replica import LeaderReplica, follow
from megatron_rl.trainer.setup import EngineFactory, Run, build_run
from megatron_rl.trainer.stop import NonFiniteGuard


def train(
    cfg: Config, *, platform: str = "auto", engine_factory: EngineFactory | None = None, replay: str | None = None
) -> list[dict]:
    """Run ``cfg.trainer.steps`` RL iterations; return the per-step metrics (on the leader).

    ``engine_factory(EngineSettings) -> RolloutEngine`` replaces ``rollout.build_engine``
    (an extension point: a remote engine service, a recording wrapper, ...). ``replay``: train on
    a ``rollout.record`` file instead of generating. SIGTERM / SIGINT end the run after the
    current step, with a checkpoint (``trainer.stop``).
    """
    run = build_run(cfg, platform=platform, engine_factory=engine_factory, replay=replay)
    run.replica.stop.install()
    if not run.is_leader:
        follow(run.replica)
        run.cleanup()
        return []
    replica, pipeline, history = LeaderReplica(run.replica), run.pipeline, []
    checkpoints, report = Checkpoints(cfg, replica), StepReport(cfg, run)
    try:
        with pipeline:
            for step in range(run.first_step, cfg.trainer.steps):
                summary, step_s = run_step(pipeline, replica)
                history.append(report.after_step(step, summary, *replica.pop_results(), step_s=step_s))
                stop = replica.poll_stop()
                checkpoints.after_step(summary, stopping=stop)
                if stop:
                    break
    except PipelineError:
        checkpoints.after_failure()  # the engines or the producer failed: keep what was trained
        raise
    finally:
        report.close()
        replica.stop_followers(failure=sys.exc_info()[1])  # a parallel.timeout_s expiry reaches every rank
        run.cleanup()
    return history


def run_step(pipeline, replica) -> tuple[BatchSummary, float]:
    """One step as every run makes it (training, ``--rollout-only``, ``bench``): the step's batch
    as its groups arrive, each micro-batch trained, one optimizer step per mini-batch, the new
    policy synced to the engines as the next version, the step completed. ``pipeline``: a
    ``Pipeline`` (or anything with its ``begin_step`` / ``complete``); ``replica``: the
    ``LeaderReplica`` calls. Returns the step's summary and its seconds."""
    start = time.perf_counter()
    batch = pipeline.begin_step()
    for mini_batch in dispatch_ahead(batch, replica):  # DP > 1: other replicas' groups go out meanwhile
        for micro_batch in mini_batch:
            replica.train_micro_batch(micro_batch)
        replica.optimizer_step()
    version = replica.sync_weights(batch.policy_version + 1)
    return pipeline.complete(batch, version), time.perf_counter() - start


class StepReport:
    """The leader's per-step metrics: computed, logged, shown on the progress line and checked
    for too many non-finite steps in a row (``trainer.max_nonfinite_steps``)."""

    def __init__(self, cfg: Config, run: Run) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.devices = count_devices(world, cfg.rollout.devices, cfg.rollout.num_engines)
        self.progress, self.engine_busy = Progress(cfg, first_step=run.first_step), EngineBusy(run.replica.engine)
        self.nonfinite = NonFiniteGuard(cfg.trainer.max_nonfinite_steps)
        self.logger, self.trimodel = run.logger, run.replica.trainer.trimodel

    def after_step(self, step: int, summary: BatchSummary, results, seconds, *, step_s: float) -> dict:
        """The metrics of ``step`` (logged and shown); raises after too many non-finite steps."""
        metrics = step_metrics(
            summary, results, seconds, step_s=step_s, memory=self.trimodel.memory_report(), devices=self.devices
        )
        metrics.update(self.engine_busy.step(metrics["time/step_s"]))
        self.logger.log(step, metrics)
        self.progress.step(format_step(step, metrics), metrics)
        self.nonfinite.check(step, metrics["train/nonfinite_steps"])
        return metrics

    def close(self) -> None:
        self.progress.close()


class Checkpoints:
    """When the leader writes a checkpoint: every ``trainer.save_every`` steps, at the end, when a
    stop was requested, and (``after_failure``) for the last complete step when the engines or
    the producer fail mid-step (the weights and optimizer state are still those of that step)."""

    def __init__(self, cfg: Config, replica: LeaderReplica) -> None:
        self.cfg, self.replica = cfg, replica
        t = cfg.trainer
        self.save_dir, self.every, self.steps = t.save_dir, t.save_every, t.steps
        self.last: BatchSummary | None = None
        self.saved_step: int | None = None

    def after_step(self, summary: BatchSummary, *, stopping: bool) -> None:
        self.last = summary
        done = summary.step + 1
        if self.save_dir and (stopping or done == self.steps or (self.every > 0 and done % self.every == 0)):
            self._save(summary)

    def after_failure(self) -> None:
        if self.save_dir and self.last is not None and self.saved_step != self.last.step + 1:
            print(f"megatron_rl: saving the last complete step ({self.last.step + 1}) before stopping", flush=True)
            self._save(self.last)

    def _save(self, summary: BatchSummary) -> None:
        self.saved_step = summary.step + 1
        self.replica.save_checkpoint(Path(self.save_dir) / f"step_{self.saved_step}", _run_state(self.cfg, summary))


def _run_state(cfg: Config, summary: BatchSummary) -> RunState:
    """Resume point after ``summary``'s step: the controller and prompt stream as they stood
    right after that batch was generated (the producer may have run ahead since)."""
    return RunState(
        step=summary.step + 1,
        controller=dict(summary.end.controller_state),
        config=config_to_dict(cfg),
        prompt_stream=dict(summary.end.source_state or {}),
    )
