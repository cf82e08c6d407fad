"""How the producer scores a finished group: shaped rewards, group advantages, the dynamic-sampling
verdict (``score_group``); a group given up before generating is an empty, not-kept group
(``failed_group``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rl.algorithms import AdvantageScale, dynamic_sampling_keep, group_advantages, overlong_reward_delta
from megatron_rl.config.fields import require_values
from megatron_rl.config.schema import AdvantageConfig, AlgorithmConfig
from megatron_rl.pipeline.records import Sample, ScoredGroup


@dataclass(frozen=True, kw_only=True)
class OverlongShaping:
    """DAPO soft overlong punishment added to the task reward (``overlong_reward_delta``)."""

    max_len: int
    buffer: int
    penalty: float = 1.0


@dataclass(frozen=True, kw_only=True)
class GroupScoring:
    """How a finished group is scored."""

    advantage_scale: AdvantageScale = AdvantageConfig.scale  # "group" (GRPO) or "none" (Dr.GRPO); not "batch"
    dynamic_sampling: bool = AlgorithmConfig.dynamic_sampling  # DAPO: drop groups whose rewards are all equal
    overlong: OverlongShaping | None = None
    eps: float = AdvantageConfig.eps  # added to the group std before dividing (algorithm.advantage.eps)
    # DAPO over-sampling (algorithm.oversample): a batch trains at most this many kept groups, the
    # first in prompt order, and aborts the prompts beyond (pipeline.oversample); None: every kept group
    target_groups: int | None = None

    def __post_init__(self) -> None:
        # the config's rules: groups are scored as they complete, so 'batch' is refused
        require_values({"algorithm.advantage.scale": self.advantage_scale, "algorithm.advantage.eps": self.eps})


def score_group(
    *,
    step: int,
    prompt_index: int,
    samples: Sequence[Sample],
    scoring: GroupScoring,
    lengths: Sequence[int] | None = None,
) -> ScoredGroup:
    """Shaped rewards ``[G]``, advantages ``[G]`` and the dynamic-sampling verdict of one group;
    ``lengths``: what overlong shaping measures (default: each response's length)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    if scoring.overlong is not None:
        lengths = torch.tensor([len(s.response_ids) for s in samples] if lengths is None else list(lengths))
        o = scoring.overlong
        rewards = rewards + overlong_reward_delta(lengths, max_len=o.max_len, buffer=o.buffer, penalty=o.penalty)
    kept = bool(dynamic_sampling_keep(rewards[None])[0]) if scoring.dynamic_sampling else True
    return ScoredGroup(
        step=step,
        prompt_index=prompt_index,
        prompt_id=samples[0].prompt_id,
        samples=tuple(samples),
        rewards=rewards,
        kept=kept,
        advantages=group_advantages(rewards[None], scale=scoring.advantage_scale, eps=scoring.eps)[0],
    )


def failed_group(*, step: int, prompt_index: int, prompt_id: str) -> ScoredGroup:
    """A prompt given up before generating (``generation.FailedGroup``): no samples, not kept. The
    batch still has its ``BatchStart.num_prompts`` groups (the consumer's count and mini-batch
    membership hold); nothing of it is trained or enters the reward mean."""
    empty = torch.zeros(0, dtype=torch.float32)
    return ScoredGroup(
        step=step,
        prompt_index=prompt_index,
        prompt_id=prompt_id,
        samples=(),
        rewards=empty,
        advantages=empty,
        kept=False,
    )
