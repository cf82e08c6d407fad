"""Rollout correction equals TRL's ``vllm_importance_sampling_*`` and off-policy masking.

TRL's code is called, not re-derived: the importance-ratio block of
``GRPOTrainer._generate_and_score_completions`` is cut out of TRL's source (between its own
comments) and executed on our tensors, and ``GRPOTrainer._compute_loss`` runs unbound with
``use_vllm=True`` and ``off_policy_mask_threshold`` set, as in ``test_algorithms_trl``.
"""

import inspect
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from megatron_rl.algorithms import (
    LossSettings,
    MismatchAlarm,
    RolloutCorrection,
    alarm_verdict,
    loss_denominator,
    policy_loss,
    rollout_correction,
)
from megatron_rl.algorithms.correction import mismatch_metrics, off_policy_keep
from tests.test_algorithms_trl import _SingleProcess

B, L, MAX_LEN = 4, 7, 9
LENGTHS = [7, 2, 5, 4]
MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
BOUNDS = [(None, 3.0), (0.5, 2.0), (0.8, None), (None, 1.2)]  # (C_min, C_max)


def _trl_ratio_block() -> str:
    """The IS-ratio block of TRL's ``_generate_and_score_completions``, dedented."""
    src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = src.index("            # Compute the importance sampling ratio when using vLLM")
    end = src.index("# Compute the per-token log probabilities for the reference model", start)
    return textwrap.dedent(src[start:end])


def _trl_ratio(mode, c_min, c_max, old, behav, mask):
    trainer = SimpleNamespace(
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=c_min,
        vllm_importance_sampling_clip_max=c_max,
    )
    scope = {
        "self": trainer,
        "torch": torch,
        "math": math,
        "completion_mask": mask,
        "tool_mask": None,
        "old_per_token_logps": old,
        "sampling_per_token_logps": behav,
    }
    exec(_trl_ratio_block(), scope)  # noqa: S102 (TRL's own source, see the module docstring)
    return scope["vllm_importance_sampling_ratio"]


def _trl_loss(loss_type, logp, old, behav, ratio, mask, adv, *, delta, eps=0.2):
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=delta,
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        importance_sampling_level="token",
        loss_type=loss_type,
        epsilon_low=eps,
        epsilon_high=eps,
        beta=0.0,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN,
        accelerator=_SingleProcess(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 3, dtype=torch.long),
        "prompt_mask": torch.ones(B, 3, dtype=torch.long),
        "completion_ids": torch.zeros(B, L, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "sampling_per_token_logps": behav,
        "importance_sampling_ratio": ratio,
        "num_items_in_batch": torch.tensor(float(sum(LENGTHS))),
    }
    return GRPOTrainer._compute_loss(fake, None, inputs)


def _tensors(seed, spread=0.15):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, L, generator=g) * 2 - 0.05).requires_grad_()
    old = logp.detach() + 0.2 * torch.randn(B, L, generator=g)
    behav = old + spread * torch.randn(B, L, generator=g)
    mask = torch.tensor([[1.0] * n + [0.0] * (L - n) for n in LENGTHS])
    behav = torch.where(mask.bool(), behav, torch.full_like(behav, float("nan")))  # padding garbage
    adv = torch.tensor([1.1, -0.4, 0.7, -1.3])
    return logp, old, behav, mask, adv


@pytest.mark.parametrize("c_min, c_max", BOUNDS)
@pytest.mark.parametrize("mode", MODES)
def test_weight_equals_trl_ratio(mode, c_min, c_max):
    _, old, behav, mask, adv = _tensors(seed=3, spread=1.0)
    s = RolloutCorrection(mode=mode, c_min=c_min, c_max=c_max)
    ours = rollout_correction(s, trainer_logp=old, behav_logp=behav, logp=old, advantages=adv, mask=mask)
    trl = _trl_ratio(mode, c_min, c_max, old, behav, mask).expand(B, L) * mask
    torch.testing.assert_close(ours.weight, trl, rtol=1e-6, atol=0)
    if mode.endswith("_mask"):
        if (c_min, c_max) == (0.5, 2.0):
            assert bool(((trl == 0) & mask.bool()).any()), "the fixture should mask something"
        assert torch.equal(ours.dropped, (trl == 0) & mask.bool())
    else:
        assert not ours.dropped.any()


@pytest.mark.parametrize(
    "kind, trl_type", [("grpo", "grpo"), ("bnpo", "bnpo"), ("dapo", "dapo"), ("dr_grpo", "dr_grpo")]
)
@pytest.mark.parametrize(
    "mode, c_min, c_max, delta",
    [
        ("sequence_mask", None, 3.0, None),  # TRL's default
        ("token_truncate", 0.5, 2.0, None),
        ("token_mask", None, 1.5, 0.05),
        ("sequence_truncate", 0.7, None, 0.0),
    ],
)
def test_loss_and_grad_equal_trl_with_vllm_correction(kind, trl_type, mode, c_min, c_max, delta):
    logp, old, behav, mask, adv = _tensors(seed=5, spread=0.3)
    s = LossSettings(
        kind=kind,
        max_response_len=MAX_LEN,
        correction=RolloutCorrection(mode=mode, c_min=c_min, c_max=c_max, delta=delta),
    )
    ours = policy_loss(
        s, logp=logp, old_logp=old, behav_logp=behav, mask=mask, advantages=adv, denominator=loss_denominator(s, mask)
    )
    ratio = _trl_ratio(mode, c_min, c_max, old, behav, mask)
    trl = _trl_loss(trl_type, logp, old, behav, ratio, mask, adv, delta=delta)
    torch.testing.assert_close(ours.loss, trl, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        torch.autograd.grad(ours.loss, logp)[0], torch.autograd.grad(trl, logp)[0], rtol=1e-6, atol=1e-8
    )


def test_off_policy_mask_equals_its_formula_and_trl():
    logp, _, behav, mask, adv = _tensors(seed=7, spread=0.5)
    for delta in (0.0, 0.05, 0.3, 10.0):
        ours = off_policy_keep(adv, logp, behav, mask, delta)
        m = mask.bool()
        seq_kl = torch.tensor([float((behav[i][m[i]] - logp.detach()[i][m[i]]).mean()) for i in range(B)])
        expected = (adv >= 0) | (seq_kl <= delta)
        assert torch.equal(ours, expected)
        trl = GRPOTrainer.get_off_policy_mask(adv[:, None], logp, behav, mask, delta)
        assert torch.equal(ours, trl[:, 0].bool())
    assert not off_policy_keep(adv, logp, behav, mask, 0.0).all()  # the fixture drops something


def test_none_mode_and_equal_logprobs_change_nothing():
    logp, old, _, mask, adv = _tensors(seed=9)
    base = LossSettings(kind="grpo")
    plain = policy_loss(base, logp=logp, old_logp=old, mask=mask, advantages=adv, denominator=4.0)
    for corr in (
        RolloutCorrection(),
        RolloutCorrection(mode="sequence_mask", c_max=3.0),
        RolloutCorrection(mode="token_truncate", c_min=0.5, c_max=2.0, delta=10.0),
    ):
        s = LossSettings(kind="grpo", correction=corr)
        out = policy_loss(s, logp=logp, old_logp=old, behav_logp=old, mask=mask, advantages=adv, denominator=4.0)
        torch.testing.assert_close(out.loss, plain.loss, rtol=0, atol=0)
        assert out.metrics.mismatch.to_log()["mismatch/logprob_abs_diff_mean"] == 0.0


def test_decoupled_only_masks_and_refuses_truncation():
    logp, old, behav, mask, adv = _tensors(seed=13, spread=0.4)
    kw = dict(logp=logp, old_logp=old, behav_logp=behav, mask=mask, advantages=adv, denominator=20.0)
    plain = policy_loss(LossSettings(kind="ppo_decoupled"), **kw)
    corr = RolloutCorrection(mode="token_mask", c_max=1.3)
    masked = policy_loss(LossSettings(kind="ppo_decoupled", correction=corr), **kw)
    # Expected: the decoupled loss with the tokens TRL's token_mask drops removed from the
    # policy term (the behaviour weight π_prox/π_behav itself is not multiplied twice).
    keep = _trl_ratio("token_mask", None, 1.3, old, behav, mask) > 0
    weight = torch.exp(old - torch.nan_to_num(behav))
    ratio = torch.exp(torch.where(mask.bool(), logp - old, 0.0))
    per_token = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None]) * weight
    expected = torch.where(keep & mask.bool(), per_token, 0.0).sum() / 20.0
    torch.testing.assert_close(masked.loss, expected, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(masked.loss, plain.loss)
    frac = masked.metrics.mismatch.to_log()["mismatch/masked_fraction"]
    assert frac == pytest.approx(float((~keep & mask.bool()).sum()) / sum(LENGTHS))
    with pytest.raises(ValueError, match="behav_weight_cap"):
        LossSettings(kind="ppo_decoupled", correction=RolloutCorrection(mode="token_truncate"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="bogus"), "mode"),
        (dict(c_min=2.0, c_max=2.0), "c_min"),
        (dict(c_max=-1.0), "c_max"),
        (dict(mode="token_truncate", c_max=None), "needs c_min or c_max"),
        (dict(delta=-0.1), "delta"),
    ],
)
def test_settings_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrection(**kwargs)


def test_metrics_formulas():
    _, old, behav, mask, _ = _tensors(seed=17, spread=0.3)
    log = mismatch_metrics(old, behav, mask).to_log()
    m = mask.bool()
    d = (old - behav)[m]
    assert log["mismatch/logprob_abs_diff_mean"] == pytest.approx(float(d.abs().mean()))
    assert log["mismatch/logprob_abs_diff_max"] == pytest.approx(float(d.abs().max()))
    assert log["mismatch/kl_k3"] == pytest.approx(float((torch.exp(d) - 1 - d).mean()))
    seq = [float(torch.exp((old - behav)[i][m[i]].sum())) for i in range(B)]
    assert log["mismatch/seq_ratio_max"] == pytest.approx(max(seq))
    assert log["mismatch/masked_fraction"] == 0.0


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_metrics_merge_across_micro_batches_equals_one_shot(mode):
    logp, old, behav, mask, adv = _tensors(seed=19, spread=0.4)
    s = LossSettings(kind="bnpo", correction=RolloutCorrection(mode=mode, c_max=1.5, delta=0.05))
    kw = dict(old_logp=old, behav_logp=behav, mask=mask, advantages=adv)
    whole = policy_loss(s, logp=logp, denominator=1.0, **kw).metrics.to_log()
    for cuts in ([slice(0, 1), slice(1, 4)], [slice(0, 2), slice(2, 3), slice(3, 4)]):
        merged = None
        for part in cuts:
            m = policy_loss(s, logp=logp[part], denominator=1.0, **{k: v[part] for k, v in kw.items()}).metrics
            merged = m if merged is None else merged.merge(m)
        assert merged.to_log() == pytest.approx(whole)
    assert whole["mismatch/masked_fraction"] > 0


def test_alarm_fires_above_thresholds_and_is_silent_below():
    _, old, behav, mask, _ = _tensors(seed=23, spread=0.3)
    metrics = mismatch_metrics(old, behav, mask)
    log = metrics.to_log(prefix="")
    below = MismatchAlarm(
        logprob_abs_diff_mean=log["logprob_abs_diff_mean"] * 1.01, kl_k3=log["kl_k3"] * 1.01, action="stop"
    )
    assert alarm_verdict(below, metrics) is None
    assert alarm_verdict(None, metrics) is None
    above = MismatchAlarm(logprob_abs_diff_mean=log["logprob_abs_diff_mean"] * 0.99, kl_k3=1e9)
    message = alarm_verdict(above, metrics)
    assert "mismatch/logprob_abs_diff_mean" in message and "kl_k3" not in message.split("Likely")[0]
    for cause in ("dtype", "top_p", "kernel", "not synced"):
        assert cause in message
    with pytest.raises(ValueError, match="action"):
        MismatchAlarm(action="panic")


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_a_ratio_exactly_at_a_bound_is_kept(mode):
    """[C_min, C_max] is closed (TRL: ``ratio < min | ratio > max`` is dropped): one counted token
    per sequence, ratios exactly at C_max and C_min are kept with their value, ratios just past
    either bound dropped. Written out here and checked against TRL's own block."""
    delta = torch.tensor([0.5, -0.5, 0.5 + 1e-5, -0.5 - 1e-5])  # float32 log-ratios
    ratio = torch.exp(delta)
    c_min, c_max = float(ratio[1]), float(ratio[0])  # the bounds are these float32 values exactly
    old = torch.stack([delta, torch.zeros(4)], dim=1)  # [4, 2]; token 1 is padding
    behav = torch.zeros(4, 2)
    mask = torch.tensor([[1.0, 0.0]] * 4)
    s = RolloutCorrection(mode=mode, c_min=c_min, c_max=c_max)
    ours = rollout_correction(s, trainer_logp=old, behav_logp=behav, logp=old, advantages=torch.ones(4), mask=mask)
    assert ours.weight[:, 0].tolist() == [c_max, c_min, 0.0, 0.0]
    assert ours.dropped[:, 0].tolist() == [False, False, True, True]
    trl = _trl_ratio(mode, c_min, c_max, old, behav, mask).expand(4, 2) * mask
    assert torch.equal(ours.weight, trl)


def _broken_engine(behav, mask):
    """``behav`` with every counted token of sequence 0 NaN and one token of sequence 2 -inf."""
    bad = torch.zeros_like(mask, dtype=torch.bool)
    bad[0, : LENGTHS[0]] = True
    bad[2, 1] = True
    broken = behav.clone()
    broken[0], broken[2, 1] = float("nan"), float("-inf")
    return broken, bad


def test_nonfinite_behaviour_logprobs_are_no_match_and_fire_every_alarm():
    """NaN / -inf engine log-probs: counted in nonfinite_behav, adding nothing to the diff sums
    (written out over the finite tokens), dropped in mode none, and over any alarm's limit."""
    _, old, behav, mask, adv = _tensors(seed=29, spread=0.3)
    broken, bad = _broken_engine(behav, mask)
    got = rollout_correction(
        RolloutCorrection(mode="none"), trainer_logp=old, behav_logp=broken, logp=old, advantages=adv, mask=mask
    )
    log = got.metrics.to_log()
    good = mask.bool() & ~bad
    d = (old - behav)[good]
    n = float(mask.sum())
    assert log["mismatch/nonfinite_behav"] == float(bad.sum()) == LENGTHS[0] + 1
    assert log["mismatch/logprob_abs_diff_mean"] == pytest.approx(float(d.abs().sum()) / n)
    assert log["mismatch/logprob_abs_diff_max"] == pytest.approx(float(d.abs().max()))
    assert log["mismatch/kl_k3"] == pytest.approx(float((torch.exp(d) - 1 - d).sum()) / n)
    assert log["mismatch/masked_fraction"] == pytest.approx(float(bad.sum()) / n)
    assert torch.equal(got.dropped, bad) and torch.equal(got.weight, good.float())
    loose = MismatchAlarm(kl_k3=1e9)
    assert alarm_verdict(loose, mismatch_metrics(old, behav, mask)) is None
    message = alarm_verdict(loose, got.metrics)
    assert message is not None and f"mismatch/nonfinite_behav = {LENGTHS[0] + 1} > 0" in message
    assert "NaN / inf log-probs" in message


def _written_out_loss(kind, logp, old, behav, mask, adv, versions, current, keep, clip=0.2):
    """Token-sum policy loss over ``keep`` only: bnpo (ratio to ``old``) or ppo_decoupled with the
    A-3PO log-linear proximal (α = 1 / max(d, 1)) and its behaviour weight."""
    total = logp.new_zeros(())
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not keep[b, t]:
                continue
            if kind == "ppo_decoupled":
                alpha = 1.0 / max(current - int(versions[b, t]), 1)
                anchor = alpha * behav[b, t] + (1 - alpha) * logp[b, t].detach()
                weight = torch.exp(anchor - behav[b, t])
            else:
                anchor, weight = old[b, t], 1.0
            ratio = torch.exp(logp[b, t] - anchor)
            total = total - torch.minimum(ratio * adv[b], ratio.clamp(1 - clip, 1 + clip) * adv[b]) * weight
    return total / mask.sum()


@pytest.mark.parametrize("kind", ["bnpo", "ppo_decoupled"])
def test_nonfinite_behaviour_logprobs_stay_out_of_the_loss_and_its_gradient(kind):
    logp, old, behav, mask, adv = _tensors(seed=31, spread=0.3)
    broken, bad = _broken_engine(behav, mask)
    versions = torch.tensor([[3], [2], [3], [1]]).expand(B, L)  # staleness 0, 1, 0, 2
    s = LossSettings(kind=kind, proximal="loglinear") if kind == "ppo_decoupled" else LossSettings(kind=kind)
    out = policy_loss(
        s,
        logp=logp,
        mask=mask,
        advantages=adv,
        denominator=float(mask.sum()),
        old_logp=old,
        behav_logp=broken,
        versions=versions,
        current_version=3,
    )
    (grad,) = torch.autograd.grad(out.loss, logp)
    want = _written_out_loss(kind, logp, old, behav, mask, adv, versions, 3, mask.bool() & ~bad)
    (want_grad,) = torch.autograd.grad(want, logp)
    assert torch.isfinite(out.loss) and bool(torch.isfinite(grad).all())
    torch.testing.assert_close(out.loss, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-7)
    assert float(out.metrics.n_tokens) == float((mask.bool() & ~bad).sum())
