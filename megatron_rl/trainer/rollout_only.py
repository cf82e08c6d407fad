"""``train --rollout-only``: generate and score the configured steps without training.

The engines, data, reward and group-size controller are built by the training set-up
(``trainer.setup``) and each step is the loop's own ``run_step``, with ``EnginesOnly`` in place
of the replicas: nothing is trained and no megatron model is built. After each batch the
engines reload the starting weights as the next version, so the pipeline's version
bookkeeping is that of a real run. With ``rollout.record`` the scored groups are written for
``python -m megatron_rl replay``. ``bench --scope rollout`` measures this run.
"""

from __future__ import annotations

import time

from megatron_rl.config import Config
from megatron_rl.pipeline import MicroBatch
from megatron_rl.rollout import RolloutEngine
from megatron_rl.trainer.loop import run_step
from megatron_rl.trainer.metrics import MetricsLogger, format_step, rollout_metrics
from megatron_rl.trainer.setup import EngineFactory, build_engines, build_pipeline
from megatron_rl.weight_sync.snapshot import SnapshotUpdate


class EnginesOnly:
    """The replica calls of ``run_step`` with nothing to train: micro-batches are packed as for
    training and dropped; a weight sync reloads ``weights`` (the starting checkpoint) as the new
    version. ``seconds`` holds the sync time of the last step."""

    def __init__(self, engine: RolloutEngine, weights: str) -> None:
        self.engine, self.weights = engine, weights
        self.seconds = {"weight_sync": 0.0}

    def train_micro_batch(self, mb: MicroBatch) -> None:
        """Nothing to train."""

    def optimizer_step(self) -> None:
        """Nothing to step."""

    def sync_weights(self, version: int) -> int:
        """The engines reload the starting weights as ``version``."""
        start = time.perf_counter()
        self.engine.load_weights(SnapshotUpdate(self.weights), version)
        self.seconds["weight_sync"] = time.perf_counter() - start
        return version


def generate_only(cfg: Config, *, engine_factory: EngineFactory | None = None) -> list[dict]:
    """Run ``cfg.trainer.steps`` rollout batches (generate, score, pack); return their metrics."""
    engine = build_engines(cfg, engine_factory)
    pipeline, replica = build_pipeline(cfg, engine, None), EnginesOnly(engine, cfg.model.hf_path)
    logger, history = MetricsLogger(cfg.trainer.log_dir), []
    try:
        with pipeline:
            for step in range(cfg.trainer.steps):
                summary, step_s = run_step(pipeline, replica)
                metrics = rollout_metrics(summary, step_s=step_s)
                metrics["time/weight_sync_s"] = replica.seconds["weight_sync"]
                logger.log(step, metrics)
                history.append(metrics)
                print(format_step(step, metrics), flush=True)
    finally:
        logger.close()
    return history
