"""Build a reward function from its config spec: a builtin name or a dotted path `pkg.mod:func`.

The object at a dotted path must itself be the reward function (a function or a callable
instance taking `(record, response_text)`); it is checked against the `RewardFn` protocol and
its signature before any rollout starts. A class is refused: instantiate it at module level
and point the spec at the instance.

Training loads its reward with `load_guarded_reward`: the same function wrapped in a
`GuardedReward` (`guard.py`), so a call that raises, times out or returns a non-number / NaN
scores 0, is counted, and never stops training.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_rl.config.resources import find_dotted
from megatron_rl.config.schema import RewardConfig
from megatron_rl.config.schema_reward_model import REWARD_COMPONENTS
from megatron_rl.rewards.base import RewardFn
from megatron_rl.rewards.builtin import BUILTIN_REWARDS
from megatron_rl.rewards.combine import CombinedReward
from megatron_rl.rewards.guard import GuardedReward

if TYPE_CHECKING:
    from megatron_rl.rewards.judge import TextBackend


def load_reward_fn(spec: str) -> RewardFn:
    """The reward function named by `spec` ("math_verify", "exact_match", "reasoning_gym", "last_number", or
    "package.module:function"); ValueError naming the spec if it cannot be used."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"reward fn must be one of {sorted(BUILTIN_REWARDS)} or 'package.module:function', got {spec!r}"
        )
    fn, why = find_dotted(spec)  # the import check-config runs too
    if why:
        raise ValueError(f"reward fn {spec!r}: {why}")
    if inspect.isclass(fn) or not isinstance(fn, RewardFn):
        raise ValueError(
            f"reward fn {spec!r} must be a function or callable instance taking "
            f"(record, response_text), got {type(fn).__name__}"
        )
    try:
        inspect.signature(fn).bind(None, "")
    except TypeError as err:
        raise ValueError(f"reward fn {spec!r} cannot be called as fn(record, response_text): {err}") from err
    return fn


def load_guarded_reward(spec: str, *, timeout_s: float | None, workers: int = 0) -> GuardedReward:
    """`load_reward_fn(spec)` wrapped in a `GuardedReward` with time limit `timeout_s`
    (reward.timeout_s); its `stats()` counts the failures. ``workers`` > 0 (reward.workers):
    a `pool.RewardPool` of that many processes instead."""
    if workers:
        from megatron_rl.rewards.pool import RewardPool  # imports this module: loaded on use

        return RewardPool(spec, workers=workers, timeout_s=timeout_s)
    return GuardedReward(load_reward_fn(spec), timeout_s=timeout_s, name=spec)


def load_reward(settings: RewardConfig, *, judge_backend: Callable[[], TextBackend] | None = None) -> GuardedReward:
    """The guarded reward ``reward.kind`` names: ``function`` (``load_guarded_reward`` of reward.fn),
    ``model`` (``model_reward.RewardModelReward``, worker processes of its own), ``judge``
    (``judge.JudgeReward`` on the engines ``judge_backend()`` starts: the composition root's), or
    ``combined`` (``combine.CombinedReward`` of the components reward.weights names)."""
    if settings.kind != "combined":
        return _component(settings, settings.kind, judge_backend)
    if not settings.weights:
        raise ValueError("reward.weights: reward.kind 'combined' needs the weight of each component")
    parts = {name: _component(settings, name, judge_backend) for name in settings.weights}
    return CombinedReward(parts, settings.weights)


def _component(settings: RewardConfig, name: str, judge_backend: Callable[[], TextBackend] | None) -> GuardedReward:
    """One reward source of ``settings`` by its reward.weights name."""
    if name == "function":
        return load_guarded_reward(settings.fn, timeout_s=settings.timeout_s, workers=settings.workers)
    if name == "model":
        from megatron_rl.rewards.model_reward import RewardModelReward  # starts worker processes: loaded on use

        return RewardModelReward(settings.model, timeout_s=settings.timeout_s)
    if name == "judge":
        if judge_backend is None:
            raise ValueError("reward.judge: a judge needs its engines (load_reward's judge_backend)")
        from megatron_rl.rewards.judge import JudgeReward, check_judge

        check_judge(settings.judge)  # refused before any engine starts
        return JudgeReward(judge_backend(), settings.judge, timeout_s=settings.timeout_s)
    raise ValueError(f"reward.weights: unknown component {name!r}; use {', '.join(REWARD_COMPONENTS)}")
