"""The rollout correction measures and corrects only the tokens sampled by the weights the
trainer compares against (staleness 0); stale tokens in ``stale`` mode are left to the decoupled
behaviour weight, so legitimate off-policy samples are never masked as an engine mismatch."""

from __future__ import annotations

import torch

from megatron_rl.algorithms import LossSettings, policy_loss
from megatron_rl.algorithms.correction import RolloutCorrection

MASKING = RolloutCorrection(mode="sequence_mask", c_max=3.0)


def _loss(correction, versions, current=5):
    torch.manual_seed(0)
    logp = (-torch.rand(2, 4)).requires_grad_()
    behav = logp.detach().clone()
    behav[0] -= 2.0  # sequence 0: the engine is far from the trainer (ratio e^8 > C_max)
    mask = torch.ones(2, 4, dtype=torch.bool)
    settings = LossSettings(kind="ppo_decoupled", proximal="loglinear", correction=correction)
    out = policy_loss(
        settings,
        logp=logp,
        mask=mask,
        advantages=torch.tensor([1.0, -0.5]),
        denominator=8.0,
        old_logp=logp.detach(),
        behav_logp=behav,
        versions=torch.tensor(versions)[:, None].expand(2, 4),
        current_version=current,
    )
    return out


def test_a_stale_sequence_is_neither_masked_nor_measured():
    stale = _loss(MASKING, versions=[4, 5])  # sequence 0 is one version old
    plain = _loss(RolloutCorrection(mode="none"), versions=[4, 5])
    torch.testing.assert_close(stale.loss, plain.loss)
    assert float(stale.metrics.mismatch.n_tokens) == 4 and float(stale.metrics.mismatch.n_masked) == 0


def test_a_fresh_sequence_with_the_same_gap_is_masked():
    fresh = _loss(MASKING, versions=[5, 5])
    plain = _loss(RolloutCorrection(mode="none"), versions=[5, 5])
    assert float(fresh.metrics.mismatch.n_masked) == 4 and float(fresh.metrics.mismatch.n_tokens) == 8
    assert not torch.allclose(fresh.loss, plain.loss)


def test_delta_masking_drops_stale_sequences_too():
    """The issue's reproduction: every sample one version old (d = 1), the engine 2 nats/token
    above the policy, δ = 0: the negative-advantage sequence is dropped (it was kept, and every
    mismatch metric read 0.0); the loss equals the plain loss without that sequence's tokens."""
    logp = (-torch.rand(2, 4, generator=torch.Generator().manual_seed(1)) - 3.0).requires_grad_()
    behav = logp.detach() + 2.0
    mask = torch.ones(2, 4, dtype=torch.bool)
    adv, versions = torch.tensor([-0.5, 1.0]), torch.full((2, 4), 4)

    def loss(correction, mask):
        settings = LossSettings(kind="ppo_decoupled", proximal="loglinear", correction=correction)
        return policy_loss(
            settings,
            logp=logp,
            mask=mask,
            advantages=adv,
            denominator=8.0,
            behav_logp=behav,
            versions=versions,
            current_version=5,
        )

    masked = loss(RolloutCorrection(mode="none", delta=0.0), mask)
    without_seq0 = loss(RolloutCorrection(mode="none"), mask & torch.tensor([[False], [True]]))
    torch.testing.assert_close(masked.loss, without_seq0.loss)
    assert masked.metrics.mismatch.to_log() == {"mismatch/n_tokens": 0.0, "mismatch/delta_dropped_tokens": 4.0}
    assert not torch.allclose(masked.loss, loss(RolloutCorrection(mode="none"), mask).loss)


def test_delta_masking_acts_on_later_mini_batches_without_an_old_copy():
    """``compare_engine=False`` (a later mini-batch, the old copy skipped): nothing is measured
    against the engine, but δ masking (π_θ against π_behav) still drops the off sequence; the loss
    equals the plain loss without it."""
    logp = (-torch.rand(2, 4, generator=torch.Generator().manual_seed(2)) - 3.0).requires_grad_()
    behav = logp.detach() + 2.0
    mask = torch.ones(2, 4, dtype=torch.bool)
    adv = torch.tensor([-0.5, 1.0])

    def loss(correction, mask):
        settings = LossSettings(kind="grpo", correction=correction)
        return policy_loss(
            settings, logp=logp, mask=mask, advantages=adv, denominator=8.0, behav_logp=behav, compare_engine=False
        )

    masked = loss(RolloutCorrection(mode="token_truncate", delta=0.0), mask)
    without_seq0 = loss(RolloutCorrection(mode="token_truncate"), mask & torch.tensor([[False], [True]]))
    torch.testing.assert_close(masked.loss, without_seq0.loss)
    assert masked.metrics.mismatch.to_log() == {"mismatch/n_tokens": 0.0, "mismatch/delta_dropped_tokens": 4.0}
