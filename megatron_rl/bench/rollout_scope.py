"""``--scope rollout``: the engines alone, measured on the run ``train --rollout-only`` makes.

``trainer.rollout_only.generate_only`` builds the engines, prompts, reward and controller with
the training set-up and runs the loop's steps with nothing to train: each step draws
``trainer.prompts_per_batch`` prompts, generates G = ``control.group_size`` samples per prompt
through the pipeline's producer (its requests, seeds and scoring) and reloads the starting
weights as the next version (the ``weight_sync`` phase). The generated groups are read back
from the engine (``e2e_scope.ShapeRecorder``). Runs on global rank 0 only (engines are never
training ranks).
"""

from __future__ import annotations

import dataclasses
import os
import resource

from megatron_rl.bench.e2e_scope import measures, recording_engines
from megatron_rl.bench.options import BenchOptions, resolve_peak
from megatron_rl.bench.result import BenchResult, aggregate
from megatron_rl.config import Config, config_to_dict
from megatron_rl.platform.device import detect_platform
from megatron_rl.trainer import from_config
from megatron_rl.trainer.build import DTYPES


def run_rollout_scope(cfg: Config, opts: BenchOptions) -> BenchResult | None:
    """Generate and score ``warmup + steps`` batches; the result (rank 0), None on other ranks."""
    if os.environ.get("RANK", "0") != "0":  # under torchrun: no process group here, rank 0 alone runs
        return None
    from megatron_rl.trainer.rollout_only import generate_only

    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, steps=opts.warmup + opts.steps))
    recorders, factory = recording_engines()
    measured = measures(generate_only(cfg, engine_factory=factory), recorders[0], opts.warmup)
    device_type = detect_platform(opts.platform).device_type
    engines = len(from_config.engine_settings(cfg).device_assignments())
    world = {
        "platform": device_type,
        "world_size": 0,
        "engines": engines,
        "engine": cfg.rollout.engine,
        "engine_tp": cfg.rollout.tensor_parallel_size,
    }
    # Engines are processes of their own: after shutdown, RUSAGE_CHILDREN holds the largest one's peak.
    memory = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6, "engine_host_rss")
    return aggregate(
        measured,
        scope="rollout",
        warmup=opts.warmup,
        devices=engines * cfg.rollout.tensor_parallel_size,
        train_devices=1,
        peak=resolve_peak(opts, device_type, DTYPES[cfg.model.dtype]),
        memory=memory,
        world=world,
        config=config_to_dict(cfg),
    )
