"""The loss table (``algorithms/loss_table.py``): one entry per ``algorithm.loss`` kind of the
schema, an unknown kind refused naming the config key, and each entry the rows of the formula
table in ``losses.py`` (the numbers themselves are ``test_algorithms_losses.py``'s)."""

from dataclasses import replace

import pytest
import torch

from megatron_rl.algorithms import LOSS_KINDS, LOSSES, LossSettings, loss_denominator, loss_entry, policy_loss

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_the_table_has_one_entry_per_schema_kind():
    assert tuple(LOSSES) == LOSS_KINDS


def test_an_unknown_kind_names_the_config_key():
    with pytest.raises(ValueError, match=r"algorithm\.loss.*'gspo'.*'grpo'"):
        loss_entry("gspo")
    with pytest.raises(ValueError, match=r"algorithm\.loss"):
        LossSettings(kind="gspo")


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("grpo", 2), ("bnpo", 4), ("dapo", 4), ("dr_grpo", 2 * 5), ("ppo_decoupled", 4)],
)
def test_each_kind_has_its_denominator(kind, expected):
    settings = LossSettings(kind=kind, max_response_len=5 if kind == "dr_grpo" else None)
    den = loss_denominator(settings, MASK)
    assert den.dtype == torch.int64 and int(den) == expected


def test_a_constant_length_kind_needs_max_response_len():
    with pytest.raises(ValueError, match="'dr_grpo' needs max_response_len"):
        LossSettings(kind="dr_grpo")


def test_only_the_decoupled_kind_takes_a_behaviour_weight():
    logp = torch.full((3, 4), -1.0, requires_grad=True)
    behav = torch.full((3, 4), -1.5)
    kw = {"logp": logp, "mask": MASK, "advantages": torch.ones(3), "denominator": 4.0, "behav_logp": behav}
    clipped = policy_loss(LossSettings(kind="bnpo"), **kw).metrics
    decoupled = policy_loss(replace(LossSettings(), kind="ppo_decoupled"), old_logp=logp.detach(), **kw).metrics
    assert clipped.behav_weight_sum is None
    assert float(decoupled.behav_weight_sum) == pytest.approx(4 * torch.exp(torch.tensor(0.5)).item())
