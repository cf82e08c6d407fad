"""Decoupled PPO and A-3PO (loglinear proximal) against formulas written out in this file.

The A-3PO reference here is AReaL's ``compute_prox_logp_approximations`` written in its own
terms (weight (v_prox − v_behav) / (v_θ − v_behav) on log π_θ, v_prox = v_θ − 1), not the
α = 1 / max(d, 1) form the code uses.
"""

import math

import pytest
import torch

from megatron_rl.algorithms import (
    LossSettings,
    loglinear_proximal_logp,
    loss_denominator,
    policy_loss,
    staleness_alpha,
)


def _areal_prox(behav, theta, v_behav, v_theta):
    v_prox = v_theta - 1
    w = (v_prox - v_behav) / (v_theta - v_behav) if v_theta > v_behav else 0.0
    w = min(max(w, 0.0), 1.0)
    return behav + w * (theta - behav)


def test_alpha_per_staleness():
    current = 7
    versions = torch.tensor([[7, 6, 5, 2]])  # d = 0, 1, 2, 5
    assert staleness_alpha(versions, current)[0].tolist() == pytest.approx([1.0, 1.0, 0.5, 0.2])


def test_loglinear_matches_areal_with_mixed_versions():
    g = torch.Generator().manual_seed(1)
    current = 9
    versions = torch.tensor([[9, 8, 7, 4, 9], [6, 6, 5, 9, 2]])
    behav, theta = -torch.rand(2, 5, generator=g) * 3, -torch.rand(2, 5, generator=g) * 3
    prox = loglinear_proximal_logp(behav, theta, versions, current, torch.ones(2, 5))
    for b in range(2):
        for t in range(5):
            expected = _areal_prox(behav[b, t].item(), theta[b, t].item(), versions[b, t].item(), current)
            assert prox[b, t].item() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    # d = 0 tokens are exactly the behaviour policy, even though π_θ ≠ π_behav there
    d0 = versions == current
    assert torch.equal(prox[d0], behav[d0]) and not torch.equal(theta[d0], behav[d0])


def test_sandwich_property():
    g = torch.Generator().manual_seed(2)
    behav, theta = -torch.rand(64, 16, generator=g) * 5, -torch.rand(64, 16, generator=g) * 5
    versions = torch.randint(0, 12, (64, 16), generator=g)
    prox = loglinear_proximal_logp(behav, theta, versions, 11, torch.ones(64, 16))
    lo, hi = torch.minimum(behav, theta), torch.maximum(behav, theta)
    assert bool(((prox >= lo - 1e-6) & (prox <= hi + 1e-6)).all())
    # and strictly inside where 1 < d and the two policies differ
    inner = (11 - versions > 1) & ((behav - theta).abs() > 1e-3)
    assert bool(((prox > lo) & (prox < hi))[inner].all())


def _decoupled_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(3, 5, generator=g) * 2 - 0.1).requires_grad_()
    behav = logp.detach() + 0.4 * torch.randn(3, 5, generator=g)
    prox = logp.detach() + 0.2 * torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0]])
    adv = torch.tensor([0.8, -1.1, 0.5])
    return logp, behav, prox, mask, adv


def _reference_decoupled(logp, prox, behav, mask, adv, clip, cap=None):
    """Σ_kept −min(r·A, clip(r)·A)·w / n_counted, r = π/π_prox, w = π_prox/π_behav (const)."""
    total, n = 0.0, 0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[b, t] == 0:
                continue
            n += 1
            w = math.exp(prox[b, t].item() - behav[b, t].item())
            if cap is not None and w > cap:
                continue
            r = torch.exp(logp[b, t] - prox[b, t].item())
            r_clip = torch.clamp(r, 1 - clip, 1 + clip)
            total = total - torch.minimum(r * adv[b], r_clip * adv[b]) * w
    return total / n


def test_decoupled_recompute_matches_formula():
    logp, behav, prox, mask, adv = _decoupled_batch()
    s = LossSettings(kind="ppo_decoupled", proximal="recompute", clip_low=0.2, clip_high=0.2)
    out = policy_loss(
        s, logp=logp, old_logp=prox, behav_logp=behav, mask=mask, advantages=adv, denominator=loss_denominator(s, mask)
    )
    expected = _reference_decoupled(logp, prox, behav, mask, adv, clip=0.2)
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(torch.autograd.grad(out.loss, logp)[0], torch.autograd.grad(expected, logp)[0])
    w = torch.exp(prox - behav)[mask.bool()]
    assert out.metrics.behav_weight_sum.item() == pytest.approx(w.sum().item(), rel=1e-6)
    assert out.metrics.behav_weight_max.item() == pytest.approx(w.max().item(), rel=1e-6)
    assert out.metrics.n_capped.item() == 0


def test_loglinear_matches_formula_with_detached_prox():
    logp, behav, _, mask, adv = _decoupled_batch(seed=4)
    versions = torch.tensor([[3, 2, 1, 3, 0], [2, 2, 2, -1, -1], [0, 1, 2, 3, -1]])
    s = LossSettings(kind="ppo_decoupled", proximal="loglinear", clip_low=0.2, clip_high=0.28)
    out = policy_loss(
        s,
        logp=logp,
        behav_logp=behav,
        versions=versions,
        current_version=3,
        mask=mask,
        advantages=adv,
        denominator=loss_denominator(s, mask),
    )
    prox = torch.tensor(
        [
            [_areal_prox(behav[b, t].item(), logp[b, t].item(), max(versions[b, t].item(), 0), 3) for t in range(5)]
            for b in range(3)
        ]
    )
    total, n = 0.0, int(mask.sum())
    for b, t in mask.nonzero().tolist():
        r = torch.exp(logp[b, t] - prox[b, t])
        r_clip = torch.clamp(r, 0.8, 1.28)
        w = math.exp(prox[b, t] - behav[b, t])
        total = total - torch.minimum(r * adv[b], r_clip * adv[b]) * w
    expected = total / n
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(torch.autograd.grad(out.loss, logp)[0], torch.autograd.grad(expected, logp)[0])


def test_loglinear_at_zero_staleness_is_standard_ppo_on_second_minibatch():
    # Second mini-batch: π_θ has moved away from π_behav, but every token has d = 0.
    logp, behav, _, mask, adv = _decoupled_batch(seed=5)
    assert (logp - behav).abs().min() > 0
    versions = torch.full((3, 5), 4)
    a3po = LossSettings(kind="ppo_decoupled", proximal="loglinear", clip_high=0.28)
    ppo = LossSettings(kind="bnpo", clip_high=0.28)
    out = policy_loss(
        a3po,
        logp=logp,
        behav_logp=behav,
        versions=versions,
        current_version=4,
        mask=mask,
        advantages=adv,
        denominator=loss_denominator(a3po, mask),
    )
    std = policy_loss(
        ppo, logp=logp, old_logp=behav, mask=mask, advantages=adv, denominator=loss_denominator(ppo, mask)
    )
    torch.testing.assert_close(out.loss, std.loss)
    torch.testing.assert_close(torch.autograd.grad(out.loss, logp)[0], torch.autograd.grad(std.loss, logp)[0])
    assert out.metrics.behav_weight_sum.item() == pytest.approx(mask.sum().item())


def test_behaviour_weight_cap_masks_tokens_and_counts_them():
    logp, behav, prox, mask, adv = _decoupled_batch(seed=6)
    cap = 1.2
    w = torch.exp(prox - behav)
    n_over = int(((w > cap) & mask.bool()).sum())
    assert 0 < n_over < int(mask.sum())  # the fixture exercises the cap
    s = LossSettings(kind="ppo_decoupled", behav_weight_cap=cap)
    den = loss_denominator(s, mask)
    out = policy_loss(s, logp=logp, old_logp=prox, behav_logp=behav, mask=mask, advantages=adv, denominator=den)
    expected = _reference_decoupled(logp, prox, behav, mask, adv, clip=0.2, cap=cap)
    torch.testing.assert_close(out.loss, expected)
    grad = torch.autograd.grad(out.loss, logp)[0]
    assert grad[(w > cap) & mask.bool()].abs().max() == 0
    assert out.metrics.n_capped.item() == n_over
    assert out.metrics.n_tokens.item() == mask.sum().item() - n_over
    assert out.metrics.behav_weight_max.item() <= cap
    assert den.item() == mask.sum().item()  # the cap does not change the normaliser


def test_decoupled_validation():
    logp, behav, prox, mask, adv = _decoupled_batch()
    s = LossSettings(kind="ppo_decoupled", proximal="loglinear")
    with pytest.raises(ValueError, match="behav_logp"):
        policy_loss(s, logp=logp, mask=mask, advantages=adv, denominator=1.0)
    with pytest.raises(ValueError, match="versions"):
        policy_loss(s, logp=logp, behav_logp=behav, mask=mask, advantages=adv, denominator=1.0)
    with pytest.raises(ValueError, match="newer than current_version"):
        policy_loss(
            s,
            logp=logp,
            behav_logp=behav,
            versions=torch.full((3, 5), 5),
            current_version=4,
            mask=mask,
            advantages=adv,
            denominator=1.0,
        )
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(
            LossSettings(kind="ppo_decoupled"), logp=logp, behav_logp=behav, mask=mask, advantages=adv, denominator=1.0
        )
