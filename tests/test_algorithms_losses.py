"""Policy losses on fixed tensors against formulas written out token by token in this file."""

import math

import pytest
import torch

from megatron_rl.algorithms import (
    LossSettings,
    kl_estimate,
    loss_denominator,
    policy_loss,
)

B, L = 4, 6
LENGTHS = [6, 3, 1, 4]


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, L, generator=g) * 2 - 0.1).requires_grad_()
    old = (logp.detach() + 0.3 * torch.randn(B, L, generator=g)).clamp(max=-0.01)
    ref = (logp.detach() + 0.2 * torch.randn(B, L, generator=g)).clamp(max=-0.01)
    mask = torch.tensor([[1.0] * n + [0.0] * (L - n) for n in LENGTHS])
    adv = torch.tensor([1.5, -0.7, 0.9, -1.2])
    return logp, old, ref, mask, adv


def _token_loss(lp, old, ref, a, s):
    """−min(r·A, clip(r)·A) + β·KL for one token, written out with scalar ops."""
    r = torch.exp(lp - old)
    r_clip = torch.clamp(r, 1 - s.clip_low, 1 + s.clip_high)
    loss = -torch.minimum(r * a, r_clip * a)
    if s.kl_coef:
        x = ref - lp  # log(ref / π)
        kl = {"k1": -x, "k2": 0.5 * x * x, "k3": torch.exp(x) - x - 1}[s.kl_estimator]
        loss = loss + s.kl_coef * kl
    return loss


def _reference_loss(s, logp, old, ref, mask, adv):
    seq_terms, total, n_tok = [], 0.0, 0
    for b in range(B):
        toks = [_token_loss(logp[b, t], old[b, t], ref[b, t], adv[b], s) for t in range(L) if mask[b, t] > 0]
        seq_terms.append(sum(toks) / len(toks))
        total, n_tok = total + sum(toks), n_tok + len(toks)
    if s.kind == "grpo":
        return sum(seq_terms) / B
    if s.kind in ("bnpo", "dapo"):
        return total / n_tok
    assert s.kind == "dr_grpo"
    return total / (B * s.max_response_len)


def _ours(s, logp, old, ref, mask, adv, **kw):
    den = loss_denominator(s, mask)
    return policy_loss(s, logp=logp, old_logp=old, ref_logp=ref, mask=mask, advantages=adv, denominator=den, **kw)


KIND_SETTINGS = [
    LossSettings(kind="grpo"),
    LossSettings(kind="bnpo"),
    LossSettings(kind="dapo", clip_low=0.2, clip_high=0.28),
    LossSettings(kind="dr_grpo", max_response_len=8),
    LossSettings(kind="grpo", kl_coef=0.1, kl_estimator="k1"),
    LossSettings(kind="bnpo", kl_coef=0.05, kl_estimator="k2"),
    LossSettings(kind="dapo", clip_high=0.28, kl_coef=0.04, kl_estimator="k3"),
    LossSettings(kind="dr_grpo", max_response_len=6, kl_coef=0.1, kl_estimator="k3"),
]


@pytest.mark.parametrize("s", KIND_SETTINGS, ids=lambda s: f"{s.kind}-kl{s.kl_coef}")
def test_loss_and_grad_match_written_out_formula(s):
    logp, old, ref, mask, adv = _batch()
    out = _ours(s, logp, old, ref, mask, adv)
    (g_ours,) = torch.autograd.grad(out.loss, logp)
    expected = _reference_loss(s, logp, old, ref, mask, adv)
    (g_ref,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-7)
    assert g_ours[mask == 0].abs().max() == 0


def test_on_policy_default_old_logp_is_detached_policy():
    logp, _, _, mask, adv = _batch()
    s = LossSettings(kind="bnpo")
    out = policy_loss(s, logp=logp, mask=mask, advantages=adv, denominator=float(sum(LENGTHS)))
    (grad,) = torch.autograd.grad(out.loss, logp)
    # ratio = 1 everywhere, so the loss is −mean(A) and dL/dlogp = −A / n_tokens on tokens.
    expected_loss = -sum(a * n for a, n in zip(adv.tolist(), LENGTHS, strict=True)) / sum(LENGTHS)
    assert out.loss.item() == pytest.approx(expected_loss, rel=1e-6)
    torch.testing.assert_close(grad, -adv[:, None] * mask / sum(LENGTHS))


def _two_token_case(clip_high):
    # token 0: ratio 1.25, A > 0; token 1: ratio 0.75, A < 0.
    logp = torch.log(torch.tensor([[1.25, 0.75]])).requires_grad_()
    old = torch.zeros(1, 2)
    s = LossSettings(kind="dapo", clip_low=0.2, clip_high=clip_high)
    out_pos = policy_loss(
        s, logp=logp, old_logp=old, mask=torch.tensor([[1.0, 0.0]]), advantages=torch.tensor([1.0]), denominator=1.0
    )
    out_neg = policy_loss(
        s, logp=logp, old_logp=old, mask=torch.tensor([[0.0, 1.0]]), advantages=torch.tensor([-1.0]), denominator=1.0
    )
    g_pos = torch.autograd.grad(out_pos.loss, logp)[0][0, 0].item()
    g_neg = torch.autograd.grad(out_neg.loss, logp)[0][0, 1].item()
    return out_pos, out_neg, g_pos, g_neg


def test_clip_higher_is_asymmetric():
    # Symmetric ε = 0.2: ratio 1.25 with A > 0 is clipped (flat, zero gradient, loss −1.2).
    pos, neg, g_pos, g_neg = _two_token_case(clip_high=0.2)
    assert pos.loss.item() == pytest.approx(-1.2) and g_pos == 0.0
    assert pos.metrics.n_clip_high.item() == 1 and pos.metrics.n_clip_low.item() == 0
    # ratio 0.75 < 1 − 0.2 with A < 0 is clipped below: loss −(0.8 · −1) = 0.8, flat.
    assert neg.loss.item() == pytest.approx(0.8) and g_neg == 0.0
    assert neg.metrics.n_clip_low.item() == 1 and neg.metrics.n_clip_high.item() == 0
    # clip_high = 0.28 lets 1.25 through (loss −1.25, gradient −r·A = −1.25); the low side
    # keeps clip_low = 0.2.
    pos, neg, g_pos, g_neg = _two_token_case(clip_high=0.28)
    assert pos.loss.item() == pytest.approx(-1.25) and g_pos == pytest.approx(-1.25)
    assert pos.metrics.n_clip_high.item() == 0
    assert neg.loss.item() == pytest.approx(0.8) and g_neg == 0.0


def test_dr_grpo_normalises_by_batch_times_max_length():
    logp, old, ref, mask, adv = _batch()
    s8 = LossSettings(kind="dr_grpo", max_response_len=8)
    s16 = LossSettings(kind="dr_grpo", max_response_len=16)
    bnpo = LossSettings(kind="bnpo")
    l8, l16 = _ours(s8, logp, old, ref, mask, adv).loss, _ours(s16, logp, old, ref, mask, adv).loss
    token_sum = _ours(bnpo, logp, old, ref, mask, adv).loss * sum(LENGTHS)
    assert loss_denominator(s8, mask).item() == B * 8
    torch.testing.assert_close(l8, token_sum / (B * 8))
    torch.testing.assert_close(l16, l8 / 2)


def test_denominators():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert loss_denominator(LossSettings(kind="grpo"), mask).item() == 2  # empty row not counted
    assert loss_denominator(LossSettings(kind="dapo"), mask).item() == 3
    assert loss_denominator(LossSettings(kind="bnpo"), mask).item() == 3
    assert loss_denominator(LossSettings(kind="dr_grpo", max_response_len=5), mask).item() == 10


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators(est):
    lp, lq = torch.tensor([-0.3, -2.0, -1.0]), torch.tensor([-0.5, -1.0, -1.0])
    expected = []
    for p, q in zip(lp.tolist(), lq.tolist(), strict=True):
        r = math.exp(q - p)
        expected.append({"k1": -math.log(r), "k2": 0.5 * math.log(r) ** 2, "k3": r - 1 - math.log(r)}[est])
    assert kl_estimate(lp, lq, est).tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_entropy_bonus_and_metrics():
    logp, old, ref, mask, adv = _batch()
    ent = torch.rand(B, L, generator=torch.Generator().manual_seed(3)).requires_grad_()
    s0 = LossSettings(kind="bnpo", clip_low=0.02, clip_high=0.04)  # asymmetric (high >= low: the schema's rule)
    s1 = LossSettings(kind="bnpo", clip_low=0.02, clip_high=0.04, entropy_coef=0.01, kl_estimator="k2")
    base = _ours(s0, logp, old, ref, mask, adv, entropy=ent)
    out = _ours(s1, logp, old, ref, mask, adv, entropy=ent)
    n = sum(LENGTHS)
    ent_mean = (ent * mask).sum() / n
    torch.testing.assert_close(out.loss, base.loss - 0.01 * ent_mean)
    # metrics, token by token
    m = out.metrics
    toks = [(b, t) for b in range(B) for t in range(LENGTHS[b])]
    ratios = [math.exp(logp[b, t].item() - old[b, t].item()) for b, t in toks]
    lows = sum(r < 0.98 and adv[b] < 0 for r, (b, _) in zip(ratios, toks, strict=True))
    highs = sum(r > 1.04 and adv[b] > 0 for r, (b, _) in zip(ratios, toks, strict=True))
    assert lows > 0 and highs > 0  # the fixture exercises both sides
    assert (m.n_tokens.item(), m.n_clip_low.item(), m.n_clip_high.item()) == (n, lows, highs)
    assert m.ratio_sum.item() == pytest.approx(sum(ratios), rel=1e-5)
    assert m.ratio_max.item() == pytest.approx(max(ratios), rel=1e-6)
    k2 = [0.5 * (ref[b, t].item() - logp[b, t].item()) ** 2 for b, t in toks]
    assert m.kl_ref_sum.item() == pytest.approx(sum(k2), rel=1e-5)
    assert m.entropy_sum.item() == pytest.approx(sum(ent[b, t].item() for b, t in toks), rel=1e-5)
    k3_old = [math.exp(lp - o) - 1 - (lp - o) for lp, o in ((logp[b, t].item(), old[b, t].item()) for b, t in toks)]
    assert m.approx_kl_sum.item() == pytest.approx(sum(k3_old), rel=1e-5)
    log = m.to_log()
    assert log["loss/clip_frac_low"] == pytest.approx(lows / n)
    assert m.behav_weight_sum is None and "loss/n_capped" not in log


def test_metrics_merge_equals_whole_batch():
    logp, old, ref, mask, adv = _batch()
    s = LossSettings(kind="dapo", clip_high=0.28, kl_coef=0.1)
    whole = _ours(s, logp, old, ref, mask, adv).metrics
    parts = [
        policy_loss(
            s,
            logp=logp[i : i + 2],
            old_logp=old[i : i + 2],
            ref_logp=ref[i : i + 2],
            mask=mask[i : i + 2],
            advantages=adv[i : i + 2],
            denominator=1.0,
        ).metrics
        for i in (0, 2)
    ]
    merged = parts[0].merge(parts[1])
    for name in ("n_tokens", "n_clip_low", "n_clip_high", "ratio_sum", "ratio_max", "approx_kl_sum", "kl_ref_sum"):
        torch.testing.assert_close(getattr(merged, name), getattr(whole, name))


def test_padding_garbage_does_not_leak():
    logp, old, ref, mask, adv = _batch()
    old, ref = old.clone(), ref.clone()
    old[mask == 0], ref[mask == 0] = -1e4, -1e4  # exp(logp − old) would overflow
    s = LossSettings(kind="bnpo", kl_coef=0.1)
    out = _ours(s, logp, old, ref, mask, adv)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert torch.isfinite(out.metrics.ratio_max) and torch.isfinite(out.metrics.kl_ref_sum)


@pytest.mark.parametrize(
    "kwargs, key",
    [  # LossSettings reports the config key of each value it carries
        (dict(kind="ppo"), "algorithm.loss"),
        (dict(clip_low=1.0), "algorithm.clip.low"),
        (dict(clip_low=0.0), "algorithm.clip.low"),  # the schema's (0, 1): a zero clip is refused here too
        (dict(clip_high=-0.1), "algorithm.clip.high"),
        (dict(clip_low=0.2, clip_high=0.1), r"algorithm.clip.high: must be >= algorithm.clip.low \(0.2\)"),
        (dict(kl_estimator="k4"), "algorithm.kl.estimator"),
        (dict(proximal="forward"), "algorithm.proximal"),
        (dict(behav_weight_cap=0.5), "algorithm.behav_weight_cap"),
        (dict(kind="dr_grpo"), "max_response_len"),
        (dict(kl_coef=-1.0), "algorithm.kl.coef"),
    ],
)
def test_settings_validation(kwargs, key):
    with pytest.raises(ValueError, match=key):
        LossSettings(**kwargs)


def test_call_validation():
    logp, old, ref, mask, adv = _batch()
    s = LossSettings(kind="bnpo", kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(s, logp=logp, mask=mask, advantages=adv, denominator=1.0)
    with pytest.raises(ValueError, match="old_logp shape"):
        policy_loss(s, logp=logp, old_logp=old[:, :2], ref_logp=ref, mask=mask, advantages=adv, denominator=1.0)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(s, logp=logp, ref_logp=ref, mask=mask, advantages=adv[:2], denominator=1.0)
    with pytest.raises(ValueError, match="denominator"):
        policy_loss(s, logp=logp, ref_logp=ref, mask=mask, advantages=adv, denominator=0)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(LossSettings(entropy_coef=0.1), logp=logp, mask=mask, advantages=adv, denominator=1.0)
