"""``rewards.RewardPool`` (``reward.workers``): rewards scored in worker processes equal the
serial path's (values and failure counts, and a whole pipeline step's groups), and a hung or
crashing reward call kills / loses one worker, which is replaced and counted."""

from __future__ import annotations

import math
import os
import time

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.data.records import PromptRecord
from megatron_rl.rewards import GuardedReward, load_reward_fn
from megatron_rl.rewards.pool import RewardPool
from tests.pipeline_fakes import FakeEngine, FakeTrainer, deadline, make_pipeline, train_one_step

pytestmark = pytest.mark.multiproc

HERE = "tests.test_rewards_pool"
RECORD = PromptRecord(prompt_id="q1", text="2+2?", answer="4")


def mixed_reward(record, text: str):
    """A number for most texts; raises, returns NaN or a string for the marked ones."""
    if "raise" in text:
        raise ValueError("marked to raise")
    if "nan" in text:
        return math.nan
    if "str" in text:
        return "four"
    return len(text) + 0.25 * len(record.prompt_id)


def hanging_or_crashing_reward(record, text: str) -> float:
    """Sleeps far past any test's timeout on 'hang', kills its process on 'crash'."""
    if text == "hang":
        time.sleep(120)
    if text == "crash":
        os._exit(3)
    return float(len(text))


def pooled_parity_reward(record, text: str) -> float:
    """``pipeline_fakes.parity_reward``, at a path a worker process imports."""
    from tests.pipeline_fakes import parity_reward

    return parity_reward(record, text)


def test_pool_scores_and_counts_as_the_serial_path():
    texts = ["a", "raise", "bbb", "nan", "str", "cc", "raise again", "dddd"] * 3
    serial = GuardedReward(load_reward_fn(f"{HERE}:mixed_reward"), timeout_s=10.0)
    pool = RewardPool(f"{HERE}:mixed_reward", workers=2, timeout_s=10.0)
    try:
        futures = [pool.submit(RECORD, t) for t in texts]
        pooled = [f.result(timeout=60) for f in futures]
    finally:
        pool.close()
    assert pooled == [serial(RECORD, t) for t in texts]
    a, b = pool.stats(), serial.stats()
    assert (
        (a.calls, a.failures)
        == (b.calls, b.failures)
        == (24, {**a.failures, "raised": 6, "non_finite": 3, "not_a_number": 3, "timeout": 0, "crashed": 0})
    )


def test_hung_and_crashing_calls_are_killed_replaced_and_counted():
    pool = RewardPool(f"{HERE}:hanging_or_crashing_reward", workers=1, timeout_s=1.5)  # one worker: it must be replaced
    try:
        pool("x", "warm")  # the worker's start is not the first call's time
        start = time.monotonic()
        scores = [pool(RECORD, t) for t in ("a", "hang", "bb", "crash", "ccc")]
        elapsed = time.monotonic() - start
    finally:
        pool.close()
    assert scores == [1.0, 0.0, 2.0, 0.0, 3.0]
    stats = pool.stats()
    assert stats.failures["timeout"] == 1 and stats.failures["crashed"] == 1 and stats.abandoned == 0
    assert "reward.timeout_s" in stats.first_error
    assert elapsed < 1.5 + 30  # the hung call cost its timeout, not its 120 s


def test_pipeline_step_with_a_pool_equals_the_serial_step():
    """The same step, scored in the producer thread and by two worker processes: the same groups
    with the same rewards and advantages (groups may complete in another order)."""

    def run(reward_fn):
        engine = FakeEngine(order_seed=3)
        pipe, trainer = make_pipeline(engine, mode="sync", num_steps=1, reward_fn=reward_fn), FakeTrainer(engine)
        with deadline(120), pipe:
            summary = train_one_step(pipe, trainer)
        return summary, {g.prompt_id: g for mb in trainer.micro_batches for g in mb.groups}

    pool = RewardPool(f"{HERE}:pooled_parity_reward", workers=2, timeout_s=30.0)
    try:
        (s_pool, pooled), (s_serial, serial) = run(pool), run(load_reward_fn(f"{HERE}:pooled_parity_reward"))
    finally:
        pool.close()
    assert pooled.keys() == serial.keys() and len(pooled) == 6
    for pid, group in serial.items():
        assert [s.reward for s in pooled[pid].samples] == [s.reward for s in group.samples]
        assert pooled[pid].advantages.tolist() == group.advantages.tolist()
    assert s_pool.reward_mean == s_serial.reward_mean and pool.stats().calls == 24


def test_reward_workers_is_checked():
    with pytest.raises(ConfigError, match="reward.workers"):
        RewardPool(f"{HERE}:mixed_reward", workers=-1, timeout_s=1.0)
    with pytest.raises(ValueError, match="reward.workers"):
        RewardPool(f"{HERE}:mixed_reward", workers=0, timeout_s=1.0)
