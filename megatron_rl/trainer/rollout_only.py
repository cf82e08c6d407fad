"""``train --rollout-only``: generate and score the configured steps without training.

The engines, data, reward and group-size controller run exactly as in training; nothing is
trained and no megatron model is built. After each batch the engines reload the starting
weights as the next version, so the pipeline's version bookkeeping is that of a real run. With
``rollout.record`` the scored groups are written for ``python -m megatron_rl replay``.
"""

from __future__ import annotations

import time

from megatron_rl.config import Config
from megatron_rl.rollout import build_engine
from megatron_rl.trainer import from_config
from megatron_rl.trainer.metrics import MetricsLogger, format_step, rollout_metrics
from megatron_rl.trainer.setup import EngineFactory, build_pipeline
from megatron_rl.weight_sync.snapshot import SnapshotUpdate


def generate_only(cfg: Config, *, engine_factory: EngineFactory | None = None) -> list[dict]:
    """Run ``cfg.trainer.steps`` rollout batches (generate, score, pack); return their metrics."""
    engine = (engine_factory or build_engine)(from_config.engine_settings(cfg))
    pipeline, logger, history = build_pipeline(cfg, engine, None), MetricsLogger(cfg.trainer.log_dir), []
    try:
        with pipeline:
            for step in range(cfg.trainer.steps):
                start = time.perf_counter()
                batch = pipeline.begin_step()
                for mini_batch in batch.mini_batches():
                    for _ in mini_batch:
                        pass  # packed like a training step, not trained
                engine.load_weights(SnapshotUpdate(cfg.model.hf_path), batch.policy_version + 1)  # same weights
                summary = pipeline.complete(batch, batch.policy_version + 1)
                metrics = rollout_metrics(summary, step_s=time.perf_counter() - start)
                logger.log(step, metrics)
                history.append(metrics)
                print(format_step(step, metrics), flush=True)
    finally:
        logger.close()
    return history
