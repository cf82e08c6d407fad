"""The on-policy distillation term (``algorithms/distill.py``): loss and gradient equal a loss
written out by hand, token by token in plain Python (the reverse-KL sample
log π_behav − log π_teacher as a per-token negative advantage on the importance ratio, Tinker's
``incorporate_kl_penalty`` + ``importance_sampling``), alone (``algorithm.loss: distill``) and added
to GRPO; observation tokens (multi-turn masks) and non-finite teacher log-probs stay out."""

import math

import pytest
import torch

from megatron_rl.algorithms import LossSettings, loss_denominator, policy_loss

B, L = 3, 5
# row 1 has an observation token in the middle (multi-turn), row 2 ends early
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g) * 3 - 0.1
    old = logp + 0.3 * torch.randn(B, L, generator=g)  # a later mini-batch: ratio != 1, clipping active
    behav = old + 0.05 * torch.randn(B, L, generator=g)
    teacher = -torch.rand(B, L, generator=g) * 3 - 0.1
    teacher[1, 2] = float("nan")  # an observation token: the teacher's value there is garbage
    teacher[0, 4] = float("-inf")  # a counted token the teacher gives probability 0: not covered
    adv = torch.tensor([1.0, -0.5, 2.0])
    return logp, old, behav, teacher, adv


def _hand_distill_token(lp, old, behav, teacher, coef):
    """coef · exp(log π_θ − log π_old) · (log π_behav − log π_teacher), the KL factor constant."""
    if not math.isfinite(teacher):
        return 0.0 * lp
    return coef * torch.exp(lp - old) * (behav - teacher)


def _hand_loss(kind, logp, old, behav, teacher, adv, coef, clip=0.2):
    """The whole loss, token by token."""
    seq_terms, n_tokens, n_seqs = [], 0, 0
    total = logp.new_zeros(())
    for b in range(B):
        seq = logp.new_zeros(())
        count = 0
        for t in range(L):
            if not MASK[b, t]:
                continue
            count += 1
            lp = logp[b, t]
            term = _hand_distill_token(lp, float(old[b, t]), float(behav[b, t]), float(teacher[b, t]), coef)
            if kind == "grpo":
                r = torch.exp(lp - float(old[b, t]))
                a = float(adv[b])
                term = term - torch.minimum(r * a, torch.clamp(r, 1 - clip, 1 + clip) * a)
            seq = seq + term
        n_tokens += count
        n_seqs += count > 0
        seq_terms.append(seq / count)
        total = total + seq
    if kind == "grpo":
        return sum(seq_terms) / n_seqs
    return total / n_tokens


def _ours(kind, logp, old, behav, teacher, adv, coef):
    settings = LossSettings(kind=kind, distill_coef=coef)
    return policy_loss(
        settings,
        logp=logp,
        mask=MASK,
        advantages=adv,
        denominator=loss_denominator(settings, MASK),
        old_logp=old,
        behav_logp=behav,
        teacher_logp=teacher,
    )


@pytest.mark.parametrize(("kind", "coef"), [("distill", 1.0), ("distill", 0.5), ("grpo", 0.7)])
def test_loss_and_gradient_equal_the_hand_written_loss(kind, coef):
    logp, old, behav, teacher, adv = _inputs()
    mine = logp.clone().requires_grad_(True)
    out = _ours(kind, mine, old, behav, teacher, adv, coef)
    out.loss.backward()
    hand = logp.clone().requires_grad_(True)
    expected = _hand_loss(kind, hand, old, behav, teacher, adv, coef)
    expected.backward()
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(mine.grad, hand.grad, rtol=1e-6, atol=1e-7)
    assert torch.isfinite(mine.grad).all()
    assert (mine.grad[~MASK] == 0).all()  # no gradient on observation tokens or padding


def test_on_policy_gradient_is_the_reverse_kl_times_the_score():
    """At π_θ = π_old, ∂ℓ/∂log π_θ(y_t) = coef · (log π_behav − log π_teacher) / N: the
    policy-gradient estimator of the reverse KL (Tinker's advantage −coef · k_t)."""
    logp, _, behav, teacher, adv = _inputs(1)
    mine = logp.clone().requires_grad_(True)
    _ours("distill", mine, logp, behav, teacher, adv, 2.0).loss.backward()
    covered = MASK & torch.isfinite(teacher)
    expected = torch.where(covered, 2.0 * (behav - teacher), torch.zeros(())) / MASK.sum()
    torch.testing.assert_close(mine.grad, expected, rtol=1e-6, atol=1e-7)


def test_distill_metrics_are_the_kl_per_covered_token():
    logp, old, behav, teacher, adv = _inputs(2)
    log = _ours("grpo", logp, old, behav, teacher, adv, 1.0).metrics.to_log()
    covered = MASK & torch.isfinite(teacher)
    assert log["distill/tokens"] == covered.sum().item() == MASK.sum().item() - 1
    assert log["distill/kl"] == pytest.approx((behav - teacher)[covered].mean().item(), rel=1e-6)


def test_the_distill_kind_ignores_rewards():
    logp, old, behav, teacher, adv = _inputs(3)
    a = _ours("distill", logp, old, behav, teacher, adv, 1.0).loss
    b = _ours("distill", logp, old, behav, teacher, -3 * adv, 1.0).loss
    assert float(a) == float(b)


def test_settings_refuse_a_distill_loss_without_its_weight_or_inputs():
    with pytest.raises(ValueError, match=r"algorithm\.loss='distill' needs distill\.coef > 0"):
        LossSettings(kind="distill")
    with pytest.raises(ValueError, match=r"distill\.coef must be >= 0"):
        LossSettings(distill_coef=-1.0)
    logp, old, behav, _, adv = _inputs()
    with pytest.raises(ValueError, match="needs teacher_logp"):
        policy_loss(
            LossSettings(distill_coef=1.0), logp=logp, mask=MASK, advantages=adv, denominator=3, behav_logp=behav
        )
