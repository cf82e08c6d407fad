"""``reward.kind: model``: a sequence-classification reward model in worker processes of its own.

The reward equals transformers' classification head on the same text, computed here one text
at a time without padding (the workers batch and pad); a worker killed in the middle of a batch
is replaced and the batch answered once, with the same numbers; a worker that keeps dying scores
its calls 0, counted as ``crashed``; a hung batch scores 0 (``timeout``) and the next is scored.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config.schema_reward_model import RewardModelConfig
from megatron_rl.data.records import PromptRecord
from megatron_rl.rewards.model_reward import RewardModelReward
from tests.reward_model_fixtures import FAULT_DIR, make_tiny_reward_model

RECORDS = [PromptRecord(prompt_id=f"p{i}", answer=str(i + 3), text=f"What is {i} + 3?") for i in range(3)]
RESPONSES = ["The answer is 3.", "4", "I think it is 5, because 2 + 3 = 5.", "no idea", "", "\\boxed{6}"]
CALLS = [(RECORDS[i % 3], text) for i, text in enumerate(RESPONSES)]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return make_tiny_reward_model(tmp_path_factory.mktemp("rm") / "model")


def hf_rewards(path, calls) -> list[float]:
    """transformers' head, one unpadded text at a time: the prompt, a newline, the response."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for record, text in calls:
        ids = tokenizer(f"{record.text}\n{text}", return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out.append(float(model(ids).logits[0, 0]))
    return out


def score_all(reward, calls) -> list[float]:
    futures = [reward.submit(record, text) for record, text in calls]
    return [f.result(timeout=120) for f in futures]


def test_reward_equals_the_classification_head(reward_model):
    reward = RewardModelReward(RewardModelConfig(path=str(reward_model), batch=4), timeout_s=60)
    try:
        got = score_all(reward, CALLS)
    finally:
        reward.close()
    want = hf_rewards(reward_model, CALLS)
    assert len(set(round(w, 3) for w in want)) == len(want)  # the texts score differently
    assert got == pytest.approx(want, abs=1e-5)
    stats = reward.stats()
    assert stats.calls == len(CALLS) and stats.failed == 0


def test_a_worker_killed_mid_batch_answers_every_call_once(reward_model, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_DIR, str(tmp_path))
    reward = RewardModelReward(
        RewardModelConfig(path=str(reward_model), batch=8),
        timeout_s=60,
        scorer="tests.reward_model_fixtures:CrashOnceScorer",
    )
    try:
        got = score_all(reward, CALLS)
    finally:
        reward.close()
    assert (tmp_path / "crash").exists() and reward.workers[0].starts == 2  # it died and was replaced
    assert got == pytest.approx(hf_rewards(reward_model, CALLS), abs=1e-5)
    assert reward.stats().calls == len(CALLS) and reward.stats().failed == 0


def test_a_worker_that_keeps_dying_scores_zero_counted(reward_model):
    reward = RewardModelReward(
        RewardModelConfig(path=str(reward_model), batch=8),
        timeout_s=60,
        scorer="tests.reward_model_fixtures:AlwaysCrashScorer",
    )
    try:
        got = score_all(reward, CALLS[:3])
    finally:
        reward.close()
    assert got == [0.0] * 3 and reward.stats().failures["crashed"] == 3


def test_a_hung_batch_times_out_and_the_next_is_scored(reward_model, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_DIR, str(tmp_path))
    reward = RewardModelReward(
        RewardModelConfig(path=str(reward_model), batch=8),
        timeout_s=3,
        scorer="tests.reward_model_fixtures:HangOnceScorer",
    )
    try:
        first = score_all(reward, CALLS[:2])
        second = score_all(reward, CALLS[2:4])
    finally:
        reward.close()
    assert first == [0.0, 0.0] and reward.stats().failures["timeout"] == 2
    assert second == pytest.approx(hf_rewards(reward_model, CALLS[2:4]), abs=1e-5)
