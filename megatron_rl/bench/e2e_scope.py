"""``--scope e2e``: ``megatron_rl.trainer.loop.train`` for ``warmup + steps`` steps, measured from
the per-step metrics it returns and from the groups its engine generated.

Phase breakdown of a step, from the trainer's side (what it waited for or computed):
``train`` / ``optimizer`` / ``weight_sync`` are the loop's ``time/…_s``; ``time/queue_wait_s``
(the trainer blocked on the queue) is the exposed part of the rollout, split into
``generation`` and ``reward`` in the producer's own proportion of the two (``time/reward_s``
when the loop logs it, else all generation) and capped at the producer's busy time
(``time/generation_s``); whatever wait remains is ``queue_wait``. ``idle`` is the loop's
``time/idle_s`` when logged, else the unexplained rest. The producer's overlapped totals go to
``extra`` (``overlapped_generation_s``, ``overlapped_reward_s``, ``overlap_fraction``).
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from collections.abc import Callable, Mapping

from megatron_rl.bench.flops import GroupShape, training_flops
from megatron_rl.bench.options import BenchOptions, peak_memory, resolve_peak
from megatron_rl.bench.result import BenchResult, StepMeasure, aggregate, phases_from_metrics
from megatron_rl.config import Config, config_to_dict
from megatron_rl.models import decoder_spec_from_hf, read_hf_config
from megatron_rl.rollout.engine_wrapper import EngineWrapper
from megatron_rl.trainer import from_config
from megatron_rl.trainer.build import DTYPES


class ShapeRecorder(EngineWrapper):
    """Passes every result through and records its prompt / response lengths by step and prompt."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.prompt_len: dict[tuple[int, str], int] = {}
        self.response_lens: dict[tuple[int, str], list[int]] = defaultdict(list)

    def generate(self, requests):
        for result in self.inner.generate(requests):
            step, prompt_id, _ = result.request_id.split("/")
            self.prompt_len[(int(step), prompt_id)] = len(result.prompt_ids)
            self.response_lens[(int(step), prompt_id)].append(len(result.response_ids))
            yield result

    def groups(self, step: int) -> tuple[GroupShape, ...]:
        """The groups generated for ``step``, in the order they were first seen."""
        return tuple(
            GroupShape(prompt_len=self.prompt_len[key], response_lens=tuple(lens))
            for key, lens in self.response_lens.items()
            if key[0] == step
        )


def recording_engines() -> tuple[list[ShapeRecorder], Callable]:
    """An engine factory for ``train`` / ``generate_only`` that wraps each pool it builds (the
    training default, ``rollout.build_engine``) in a ``ShapeRecorder``, and the recorders."""
    from megatron_rl.rollout import build_engine

    recorders: list[ShapeRecorder] = []

    def factory(settings):
        recorders.append(ShapeRecorder(build_engine(settings)))
        return recorders[-1]

    return recorders, factory


def measures(
    history: list[dict],
    recorder: ShapeRecorder,
    warmup: int,
    *,
    flops: Callable[[tuple[GroupShape, ...]], float] | None = None,
) -> list[StepMeasure]:
    """The measured steps (after ``warmup``) of a run's per-step metrics and its engine's groups."""
    out = []
    for step, m in enumerate(history[warmup:], start=warmup):
        groups = recorder.groups(step)
        out.append(
            StepMeasure(
                step_s=m["time/step_s"],
                phases=phases_from_metrics(m),
                groups=groups,
                flops=flops(groups) if flops else 0.0,
            )
        )
    return out


def run_e2e_scope(cfg: Config, opts: BenchOptions) -> BenchResult | None:
    """Train ``warmup + steps`` steps; the result on the leader (None on other ranks)."""
    from megatron_rl.platform.device import detect_platform
    from megatron_rl.trainer.loop import train

    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, steps=opts.warmup + opts.steps))
    recorders, factory = recording_engines()
    history = train(cfg, platform=opts.platform, engine_factory=factory)
    if not history or os.environ.get("RANK", "0") != "0":  # global rank 0 reports
        return None
    spec = decoder_spec_from_hf(read_hf_config(cfg.model.hf_path))
    frozen = len(from_config.trimodel_plan(cfg).active) - 1
    measured = measures(
        history, recorders[0], opts.warmup, flops=lambda groups: training_flops(spec, groups, frozen_forwards=frozen)
    )
    plat = detect_platform(opts.platform)
    device_type = plat.device_type
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's: every training rank
    engines = len(from_config.engine_settings(cfg).device_assignments()) * cfg.rollout.tensor_parallel_size
    world = {
        "platform": plat.name,
        "world_size": world_size,
        "tp": cfg.parallel.tp,
        "pp": cfg.parallel.pp,
        "dp": world_size // (cfg.parallel.tp * cfg.parallel.pp),
        "engines": engines,
        "engine": cfg.rollout.engine,
        "pipeline": cfg.pipeline.mode,
    }
    rest = history[opts.warmup :]
    return aggregate(
        measured,
        scope="e2e",
        warmup=opts.warmup,
        devices=world_size + engines,
        train_devices=world_size,
        peak=resolve_peak(opts, device_type, DTYPES[cfg.model.dtype]),
        memory=_memory(rest, device_type),
        world=world,
        config=config_to_dict(cfg),
        extra={**_overlap(rest), "frozen_forwards": float(frozen)},
    )


def _overlap(rest: list[Mapping[str, float]]) -> dict[str, float]:
    """The producer's overlapped totals, and cross-checks against the loop's own throughput
    metrics when it logs them."""
    busy = sum(m.get("time/generation_s", 0.0) for m in rest) / len(rest)
    exposed = sum(min(m.get("time/queue_wait_s", 0.0), m.get("time/generation_s", 0.0)) for m in rest) / len(rest)
    extra = {
        "overlapped_generation_s": busy,
        "overlapped_reward_s": sum(m.get("time/reward_s", 0.0) for m in rest) / len(rest),
        "overlap_fraction": 1 - exposed / busy if busy > 0 else 0.0,
        "groups_dropped": sum(m.get("rollout/groups_dropped", 0.0) for m in rest),
        "logged_response_tokens": sum(m.get("rollout/response_tokens", 0.0) for m in rest),
    }
    for key in ("throughput/tokens_per_s_per_device", "throughput/completion_tokens_per_s"):
        if all(key in m for m in rest):
            extra["logged_" + key.split("/")[1]] = sum(m[key] for m in rest) / len(rest)
    if all("train/prompt_tokens" in m for m in rest):
        extra["logged_prompt_tokens"] = sum(m["train/prompt_tokens"] for m in rest)
    return extra


def _memory(rest: list[Mapping[str, float]], device_type: str) -> tuple[float, str]:
    """The loop's ``memory/peak_gb`` when it logs one, else this process's peak."""
    logged = [m["memory/peak_gb"] for m in rest if "memory/peak_gb" in m]
    return (max(logged), "logged") if logged else peak_memory(device_type)
