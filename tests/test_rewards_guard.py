"""``GuardedReward``: a reward that raises, exceeds ``reward.timeout_s``, or returns a
non-number / NaN / inf scores 0 for that sample, is counted by kind, and never raises; good
calls pass through; empty responses score 0 with every builtin. The time limit also holds where
training calls the reward, in the pipeline's producer thread, and reaches the step's metrics."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from megatron_rl.config import RewardConfig
from megatron_rl.data import PromptRecord
from megatron_rl.rewards import BUILTIN_REWARDS, GuardedReward, load_guarded_reward

RECORD = PromptRecord(prompt_id="p7", text="1 + 1?", answer="2")
_release = threading.Event()


def raising(record, text):
    raise KeyError("no such field")


def sleepy(record, text):
    _release.wait(30)
    return 1.0


def constant(value):
    def fn(record, text):
        return value

    return fn


@pytest.mark.parametrize(
    ("fn", "kind", "message"),
    [
        (raising, "raised", "KeyError: 'no such field'"),
        (constant("1.0"), "not_a_number", "returned str '1.0'"),
        (constant(None), "not_a_number", "returned NoneType"),
        (constant([1.0]), "not_a_number", "returned list"),
        (constant(torch.ones(2)), "not_a_number", "returned Tensor"),
        (constant(float("nan")), "non_finite", "returned nan"),
        (constant(float("-inf")), "non_finite", "returned -inf"),
    ],
)
def test_failure_scores_zero_and_is_counted(fn, kind, message):
    guarded = GuardedReward(fn, timeout_s=5.0)
    assert guarded(RECORD, "x") == 0.0 and guarded(RECORD, "y") == 0.0
    stats = guarded.stats()
    assert stats.calls == 2 and stats.failed == 2 and stats.failures[kind] == 2
    assert stats.first_error.startswith(f"{kind} on prompt 'p7': ") and message in stats.first_error
    assert stats.as_metrics()[f"reward/failures_{kind}"] == 2.0


def test_timeout_scores_zero_within_the_limit_and_training_goes_on():
    _release.clear()
    guarded = GuardedReward(sleepy, timeout_s=0.3)
    start = time.monotonic()
    assert guarded(RECORD, "x") == 0.0
    assert time.monotonic() - start < 2.0
    stats = guarded.stats()
    assert stats.failures["timeout"] == 1 and stats.abandoned == 1 and "reward.timeout_s" in stats.first_error
    _release.set()  # the abandoned call finishes later; its result is ignored
    assert guarded(RECORD, "x") == 1.0
    time.sleep(0.1)
    assert guarded.stats().abandoned == 0 and guarded.stats().calls == 2


@pytest.mark.parametrize("value", [1, 0.5, True, np.float32(0.25), torch.tensor(0.75)])
def test_numbers_pass_through(value):
    guarded = GuardedReward(constant(value), timeout_s=5.0)
    assert guarded(RECORD, "x") == float(value) and guarded.stats().failed == 0


def test_inline_mode_without_time_limit():
    guarded = GuardedReward(raising, timeout_s=None)
    assert guarded(RECORD, "x") == 0.0 and guarded.stats().failures["raised"] == 1


def test_loaded_from_the_config_spec():
    guarded = load_guarded_reward("tests.test_rewards_guard:raising", timeout_s=RewardConfig().timeout_s)
    assert guarded(RECORD, "x") == 0.0 and guarded.name == "tests.test_rewards_guard:raising"
    assert load_guarded_reward("exact_match", timeout_s=1.0)(RECORD, "so \\boxed{2}") == 1.0
    with pytest.raises(ValueError, match="reward.timeout_s"):
        GuardedReward(raising, timeout_s=0)


@pytest.mark.parametrize("name", ["math_verify", "exact_match", "last_number"])
def test_empty_response_scores_zero(name):
    guarded = GuardedReward(BUILTIN_REWARDS[name], timeout_s=30.0)
    assert guarded(RECORD, "") == 0.0 and guarded.stats().failed == 0


_stuck = threading.Event()


def _stuck_on_p2(record, text):
    """1.0, after a 3 s hang for every sample of prompt "p2" (released early at the test's end)."""
    if record.prompt_id == "p2":
        _stuck.wait(3.0)
    return 1.0


def test_timeout_holds_in_the_producer_thread_and_reaches_the_step_metrics():
    """In training the reward runs in the producer thread, not the main one: there too a hung call
    scores 0 after ``timeout_s`` and is counted in the step's ``reward/failures_timeout``. The
    count is checked against the samples of the hung prompt the engine generated."""
    from tests.pipeline_fakes import FakeEngine, FakeTrainer, deadline, make_pipeline, train_one_step

    _stuck.clear()
    guarded, callers = GuardedReward(_stuck_on_p2, timeout_s=0.5), set()

    def reward(record, text):
        callers.add(threading.current_thread().name)
        return guarded(record, text)

    engine = FakeEngine(order_seed=1)
    trainer = FakeTrainer(engine)
    try:
        with deadline(60), make_pipeline(engine, mode="periodic", num_steps=1, reward_fn=reward) as pipe:
            pipe._extra_metrics = lambda: guarded.stats().as_metrics()  # as trainer.setup.build_pipeline wires it
            summary = train_one_step(pipe, trainer)
    finally:
        _stuck.set()
    assert callers == {"megatron_rl-producer"}
    hung = [r.request_id for r in engine.results if "/p2/" in r.request_id]
    assert len(hung) == 4
    assert summary.extra_metrics["reward/failures_timeout"] == len(hung)
    assert summary.extra_metrics["reward/failures"] == len(hung)
    rewards = {s.request_id: s.reward for mb in trainer.micro_batches for g in mb.groups for s in g.samples}
    assert rewards == {r.request_id: 0.0 if r.request_id in hung else 1.0 for r in engine.results}


def test_the_first_failure_is_kept_and_each_kind_warns_once(caplog):
    """Two kinds, each failing twice: the first error stays the first one, one warning per kind."""
    by_prompt = {"a": "x", "b": float("nan")}
    guarded = GuardedReward(lambda record, text: by_prompt[record.prompt_id], timeout_s=5.0, name="mixed")
    with caplog.at_level("WARNING", logger="megatron_rl.rewards.guard"):
        for prompt_id in ("a", "b", "a", "b"):
            assert guarded(PromptRecord(prompt_id=prompt_id, text="?", answer="1"), "y") == 0.0
    stats = guarded.stats()
    assert stats.failures["not_a_number"] == 2 and stats.failures["non_finite"] == 2
    assert stats.first_error.startswith("not_a_number on prompt 'a': "), stats.first_error
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reward mixed: ")]
    assert len(warned) == 2 and "not_a_number" in warned[0] and "non_finite" in warned[1], warned
