"""Rules of ``algorithm.oversample`` (DAPO over-sampling) and the prompt count it draws.

With ``oversample`` f > 1 every batch draws ``drawn_prompts`` = ceil(prompts_per_batch x f)
prompts, generates them all, trains the first ``prompts_per_batch`` groups in prompt order that
dynamic sampling keeps, and aborts the prompts it will not need once that is decided
(``pipeline.oversample``). It therefore needs dynamic sampling, a drawn count the mini-batches
divide, a queue that holds the drawn groups, and trajectories that are one engine request each
(``single_turn``: the abort names requests; a multi-turn trajectory's later turns are not known
up front). ``rollout.carry_over`` (partial rollout, ``pipeline.carry_over``) carries up to
``carried_prompts`` aborted prompts into the next batch, which then holds that many more.
"""

from __future__ import annotations

import math

from .fields import Found
from .schema import Config

KEY = "algorithm.oversample"


def drawn_prompts(prompts_per_batch: int, oversample: float) -> int:
    """Prompts drawn per batch: ceil(prompts_per_batch x oversample) (rounding noise ignored)."""
    return math.ceil(round(prompts_per_batch * oversample, 9))


def check_oversample(cfg: Config) -> Found:
    """Refuse ``algorithm.oversample`` where it cannot work (module doc), naming the key."""
    a, t, p = cfg.algorithm, cfg.trainer, cfg.pipeline
    if a.oversample == 1:
        return
    drawn = drawn_prompts(t.prompts_per_batch, a.oversample)
    if not a.dynamic_sampling:
        yield KEY, f"{a.oversample} over-samples for dynamic sampling: set algorithm.dynamic_sampling true, or use 1"
    if drawn % t.mini_batches:
        yield (
            KEY,
            f"{a.oversample} draws {drawn} prompts per batch (ceil of trainer.prompts_per_batch "
            f"{t.prompts_per_batch} x {a.oversample}), which trainer.mini_batches ({t.mini_batches}) does not "
            "divide; pick a factor whose drawn count it divides",
        )
    generator = cfg.rollout.generator
    if generator not in ("auto", "single_turn") or (generator == "auto" and cfg.environment.kind != "none"):
        yield (
            KEY,
            f"needs the single_turn generator (rollout.generator {generator!r}, environment.kind "
            f"{cfg.environment.kind!r}): only single-turn requests can be aborted by id",
        )
    prompts = drawn + carried_prompts(cfg)
    ahead = (p.max_staleness + 1) * prompts
    if p.queue_size < ahead:
        yield (
            KEY,
            f"a batch holds up to {prompts} prompts (drawn and carried over); pipeline.queue_size "
            f"{p.queue_size} cannot hold the {ahead} groups (max_staleness + 1) x that the producer may run "
            "ahead by: raise pipeline.queue_size",
        )


def carried_prompts(cfg: Config) -> int:
    """Prompts ``rollout.carry_over`` may carry into a batch: the over-sampled surplus (drawn -
    prompts_per_batch) rounded down to a multiple of trainer.mini_batches; 0 when it is off."""
    t = cfg.trainer
    if not cfg.rollout.carry_over or cfg.algorithm.oversample == 1:
        return 0
    surplus = drawn_prompts(t.prompts_per_batch, cfg.algorithm.oversample) - t.prompts_per_batch
    return surplus // t.mini_batches * t.mini_batches


def check_carry_over(cfg: Config) -> Found:
    """Refuse ``rollout.carry_over`` (partial rollout) where it cannot work, naming the key: it
    carries what over-sampling aborts, tokens one version behind the next batch's policy (stale
    mode only), and merges no MoE routes."""
    if not cfg.rollout.carry_over:
        return
    key, a = "rollout.carry_over", cfg.algorithm
    if a.oversample == 1:
        yield key, "carries the prompts algorithm.oversample aborts: set algorithm.oversample > 1, or set it false"
    elif carried_prompts(cfg) == 0:
        yield (
            key,
            f"algorithm.oversample {a.oversample} leaves fewer surplus prompts than trainer.mini_batches "
            f"({cfg.trainer.mini_batches}), the unit a batch grows by: nothing would be carried; raise the factor",
        )
    if cfg.pipeline.mode != "stale":
        yield (
            key,
            f"needs pipeline.mode 'stale' (got {cfg.pipeline.mode!r}): carried tokens were sampled by an older "
            "version than the batch that trains them",
        )
    if a.routing_replay == "rollout":
        yield key, "cannot be combined with algorithm.routing_replay 'rollout' (a continued request's routes split)"
