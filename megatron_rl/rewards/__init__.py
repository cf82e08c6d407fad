"""Reward functions: (PromptRecord, response text) -> float, callable from any thread.

Contract: `RewardFn` in `base.py`; the answer format is the last `\\boxed{...}` of the response
(`extract_boxed`). Build one with `load_reward_fn("math_verify" | "exact_match" |
"reasoning_gym" | "package.module:function")`; training wraps it with `load_guarded_reward(spec, timeout_s=...)`
(`GuardedReward`: failures score 0 and are counted in `RewardStats`). Rewards computed by a model
(`reward.kind`): `model_reward` (a sequence-classification model in worker processes of its own),
batched off the producer thread (`batched`); `load_reward(reward config)` builds the one a run names.
Worker processes (the reward pool's, the reward model's) share one lifecycle: `process_worker`.
"""

from megatron_rl.rewards.base import RewardFn, extract_boxed
from megatron_rl.rewards.builtin import (
    BUILTIN_REWARDS,
    exact_match_reward,
    last_number_reward,
    math_verify_reward,
    normalize_answer,
    reasoning_gym_reward,
)
from megatron_rl.rewards.guard import FAILURE_KINDS, GuardedReward, RewardStats
from megatron_rl.rewards.loader import load_guarded_reward, load_reward, load_reward_fn

__all__ = [
    "BUILTIN_REWARDS",
    "FAILURE_KINDS",
    "GuardedReward",
    "RewardFn",
    "RewardStats",
    "exact_match_reward",
    "last_number_reward",
    "extract_boxed",
    "load_guarded_reward",
    "load_reward",
    "load_reward_fn",
    "math_verify_reward",
    "normalize_answer",
    "reasoning_gym_reward",
]
