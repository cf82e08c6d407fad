"""``reward.kind: combined``: Σ weight × component reward, with per-component metrics.

The expected sums and means are written out by hand from the components' own functions; a
component's failure stays its own (0 there, counted), a component's exception stops the call.
"""

from __future__ import annotations

import pytest

from megatron_rl.config.schema import RewardConfig
from megatron_rl.config.schema_reward_model import JudgeConfig
from megatron_rl.data.records import PromptRecord
from megatron_rl.rewards import GuardedReward, load_reward
from megatron_rl.rewards.combine import CombinedReward

RECORD = PromptRecord(prompt_id="p", answer="12", text="What is 7 + 5?")


def length_reward(record, text):
    return float(len(text))


def digit_reward(record, text):
    if text == "boom":
        raise ValueError("boom")
    return float(sum(c.isdigit() for c in text))


def test_weighted_sum_and_metrics_per_component():
    parts = {
        "function": GuardedReward(length_reward, timeout_s=None),
        "model": GuardedReward(digit_reward, timeout_s=None),
    }
    combined = CombinedReward(parts, {"function": 1.0, "model": -0.5})
    texts = ["12", "abc", "boom", "7 + 5 = 12"]
    got = [combined.submit(RECORD, t).result(timeout=10) for t in texts]
    lengths, digits = [2.0, 3.0, 4.0, 10.0], [2.0, 0.0, 0.0, 4.0]  # "boom" raised: 0, counted
    assert got == pytest.approx([a - 0.5 * b for a, b in zip(lengths, digits, strict=True)])
    metrics = combined.stats().as_metrics()
    assert metrics["reward/function_mean"] == pytest.approx(sum(lengths) / 4)
    assert metrics["reward/model_mean"] == pytest.approx(sum(digits) / 4)
    assert metrics["reward/model_failures"] == 1.0 and metrics["reward/function_failures"] == 0.0
    assert metrics["reward/calls"] == 4.0 and metrics["reward/failures_raised"] == 1.0
    combined.submit(RECORD, "1").result(timeout=10)
    after = combined.stats().as_metrics()  # means of the calls since the previous stats(): one step's
    assert after["reward/function_mean"] == 1.0 and after["reward/model_mean"] == 1.0


class BrokenJudge:
    def complete(self, prompts):
        raise RuntimeError("judge engines out of restarts")

    def shutdown(self):
        pass


def test_load_reward_combines_what_weights_name_and_a_component_error_stops_the_call():
    settings = RewardConfig(
        kind="combined",
        fn="exact_match",
        weights={"function": 2.0, "judge": 1.0},
        judge=JudgeConfig(model="/j", rubric=""),
    )
    combined = load_reward(settings, judge_backend=BrokenJudge)
    assert isinstance(combined, CombinedReward) and set(combined.components) == {"function", "judge"}
    with pytest.raises(RuntimeError, match="out of restarts"):
        combined.submit(RECORD, "\\boxed{12}").result(timeout=10)
    combined.close()
    with pytest.raises(ValueError, match="reward.weights"):
        load_reward(RewardConfig(kind="combined", weights={"function": 1.0, "rubric": 1.0}))
