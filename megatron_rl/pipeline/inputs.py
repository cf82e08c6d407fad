"""What a pipeline is given: the rollout inputs built at the composition root (``RolloutInputs``)
and the steps it runs (``StepSpan``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_rl.control import GroupSizeController
from megatron_rl.generation.base import Generator, PromptItem
from megatron_rl.pipeline.carry_over import CarryOver
from megatron_rl.pipeline.scoring import GroupScoring
from megatron_rl.pipeline.teacher import TeacherStage
from megatron_rl.rollout.types import RolloutEngine


class PromptSource(Protocol):
    """Yields the prompts of each step (``data.PromptStream`` fits; ``state_dict`` is optional)."""

    def next_batch(self) -> Sequence[PromptItem]: ...


RewardCallable = Callable[[Any, str], float]  # (record, decoded response) -> reward; rewards.RewardFn fits


@dataclass(frozen=True, kw_only=True)
class RolloutInputs:
    """What generates and scores a run's batches (built once, at the composition root)."""

    engine: RolloutEngine
    prompts: PromptSource
    generator: Generator
    reward_fn: RewardCallable  # the task reward, for trajectories without an environment reward
    controller: GroupSizeController  # chooses G per batch; the producer thread owns it
    scoring: GroupScoring
    teacher: TeacherStage | None = None  # on-policy distillation: scores each completed group (pipeline.teacher)
    carry_over: CarryOver | None = None  # partial rollout: aborted prompts continue next batch (pipeline.carry_over)


@dataclass(frozen=True, kw_only=True)
class StepSpan:
    """The steps a pipeline runs: ``start_step`` (a resumed run's step) and ``num_steps`` after it."""

    num_steps: int
    start_step: int = 0

    def __post_init__(self) -> None:
        if self.num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {self.num_steps}")

    @property
    def steps(self) -> range:
        return range(self.start_step, self.start_step + self.num_steps)
