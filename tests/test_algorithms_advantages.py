"""Advantages, dynamic sampling and overlong shaping against formulas written out here."""

import math

import pytest
import torch

from megatron_rl.algorithms import dynamic_sampling_keep, group_advantages, overlong_reward_delta


def _mean(xs):
    return sum(xs) / len(xs)


def _std_unbiased(xs):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [2.0, -1.0, 0.0, 3.0]]


def test_group_scale_matches_formula():
    eps = 1e-6
    got = group_advantages(torch.tensor(REWARDS), scale="group", eps=eps)
    for g, row in zip(REWARDS, got.tolist(), strict=True):
        if len(set(g)) == 1:
            assert row == [0.0] * len(g)
            continue
        m, s = _mean(g), _std_unbiased(g)
        assert row == pytest.approx([(r - m) / (s + eps) for r in g], rel=1e-6)


def test_batch_scale_uses_std_of_all_rewards():
    eps = 1e-6
    flat = [r for g in REWARDS for r in g]
    s = _std_unbiased(flat)
    got = group_advantages(torch.tensor(REWARDS), scale="batch", eps=eps)
    for g, row in zip(REWARDS, got.tolist(), strict=True):
        m = _mean(g)
        expected = [0.0] * len(g) if len(set(g)) == 1 else [(r - m) / (s + eps) for r in g]
        assert row == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_dr_grpo_none_scale_is_mean_centred_only():
    got = group_advantages(torch.tensor(REWARDS), scale="none")
    for g, row in zip(REWARDS, got.tolist(), strict=True):
        assert row == pytest.approx([r - _mean(g) for r in g], abs=1e-7)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_degenerate_groups_are_exactly_zero(scale):
    # The float32 mean of seven 0.1s is not 0.1, so naive (r - mean) / (0 + eps) is ~0.007.
    groups = [torch.full((7,), 0.1), torch.tensor([7.0]), torch.tensor([1.0, 0.0])]
    assert (groups[0] - groups[0].mean()).abs().max() > 0
    got = group_advantages(groups, scale=scale)
    assert got[0].tolist() == [0.0] * 7
    assert got[1].tolist() == [0.0]
    assert got[2].abs().min() > 0


def test_ragged_groups_match_per_group_formula():
    groups = [[1.0, 0.0, 1.0], [3.0, 1.0], [0.0, 0.0, 0.0, 1.0, 2.0]]
    got = group_advantages([torch.tensor(g) for g in groups], scale="group", eps=0.0)
    for g, t in zip(groups, got, strict=True):
        m, s = _mean(g), _std_unbiased(g)
        assert t.tolist() == pytest.approx([(r - m) / s for r in g], rel=1e-6)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(2, 2), scale="global")
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match=r"rewards\[1\]"):
        group_advantages([torch.ones(2), torch.ones(0)])


def test_dynamic_sampling_drops_all_equal_groups():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 2.0, 2.5]])
    assert dynamic_sampling_keep(rewards).tolist() == [False, True, False, True]
    ragged = [torch.tensor([1.0]), torch.tensor([0.0, 1.0]), torch.tensor([3.0, 3.0])]
    assert dynamic_sampling_keep(ragged).tolist() == [False, True, False]


def test_overlong_soft_punishment_piecewise():
    max_len, buffer, penalty = 20, 8, 0.5
    lengths = [1, 12, 13, 16, 19, 20, 21, 40]

    def dapo_eq13(n):  # DAPO paper, eq. 13, times the penalty factor
        if n <= max_len - buffer:
            return 0.0
        if n <= max_len:
            return penalty * ((max_len - buffer) - n) / buffer
        return -penalty

    got = overlong_reward_delta(torch.tensor(lengths), max_len=max_len, buffer=buffer, penalty=penalty)
    assert got.tolist() == pytest.approx([dapo_eq13(n) for n in lengths])
    assert got.tolist()[5] == pytest.approx(-penalty)  # the full length gets the whole penalty


def test_overlong_zero_buffer_and_validation():
    got = overlong_reward_delta(torch.tensor([5, 10, 11]), max_len=10, buffer=0)
    assert got.tolist() == [0.0, 0.0, -1.0]
    with pytest.raises(ValueError, match="buffer"):
        overlong_reward_delta(torch.tensor([1]), max_len=10, buffer=11)
    with pytest.raises(ValueError, match="penalty"):
        overlong_reward_delta(torch.tensor([1]), max_len=10, buffer=2, penalty=-1.0)
