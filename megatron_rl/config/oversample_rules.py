"""Rules of ``algorithm.oversample`` (DAPO over-sampling) and the prompt count it draws.

With ``oversample`` f > 1 every batch draws ``drawn_prompts`` = ceil(prompts_per_batch x f)
prompts, generates them all, trains the first ``prompts_per_batch`` groups in prompt order that
dynamic sampling keeps, and aborts the prompts it will not need once that is decided
(``pipeline.oversample``). It therefore needs dynamic sampling, a drawn count the mini-batches
divide, a queue that holds the drawn groups, and trajectories that are one engine request each
(``single_turn``: the abort names requests; a multi-turn trajectory's later turns are not known
up front).
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
    ahead = (p.max_staleness + 1) * drawn
    if p.queue_size < ahead:
        yield (
            KEY,
            f"draws {drawn} prompts per batch; pipeline.queue_size {p.queue_size} cannot hold the {ahead} groups "
            "(max_staleness + 1) x drawn prompts the producer may run ahead by: raise pipeline.queue_size",
        )
