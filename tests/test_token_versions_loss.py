"""Per-token weight versions reach the loss (issue 31): a batch whose samples span versions, as
in-flight weight updates produce (token_versions (3, 3, 3, 4, 4) trained by version 5), goes
through the data path (``make_micro_batch``) and the trainer's micro-step loss
(``PolicyTrainer._micro_loss``); the loss value and its gradient w.r.t. the policy logits equal
a loss written out here token by token with each token's own staleness d = 5 - v:

- ``ppo_decoupled`` + ``proximal: loglinear`` (A-3PO): log π_prox = α log π_behav + (1 − α) log π_θ,
  α = 1 / max(d, 1) per token, behaviour weight π_prox / π_behav;
- ``ppo_decoupled`` + ``proximal: recompute`` with ``token_mask``: only tokens of version 5 are a
  same-weights comparison, so only they can be masked;
- ``grpo`` with ``token_truncate``: only tokens of version 5 get the truncated ratio π_old / π_behav;

and the mismatch metrics count exactly the version-5 tokens (sample 1 spans 3, 4, 5: its two
version-5 tokens alone). The reference never builds a ``[B, L]`` tensor nor calls the loss code.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.algorithms import LossSettings
from megatron_rl.algorithms.correction import RolloutCorrection
from megatron_rl.pipeline import GroupScoring, Sample, make_micro_batch, score_group
from megatron_rl.trainer.policy_step import PolicyTrainer
from megatron_rl.trimodel import TriLogprobs

POLICY = 5  # the version being trained
VOCAB = 7
PROMPT = (1, 2, 3)
# (weight_version, token_versions, reward): spanning 3 -> 4, 3 -> 5, and one at the policy's version
SPECS = [(3, (3, 3, 3, 4, 4), 1.0), (3, (3, 4, 5, 5), 0.0), (5, None, 0.0)]
LENGTHS = [5, 4, 3]
C_MIN, C_MAX = 0.8, 1.25
CLIP = 0.2


class Case:
    """Logits, a behaviour and an old policy, and the micro-batch of three samples built on them."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(31)
        n = sum(LENGTHS)
        self.logits = torch.randn(n, VOCAB, generator=g)
        self.targets = torch.randint(0, VOCAB, (n,), generator=g)
        logp0 = _logp(self.logits, self.targets).detach()
        self.behav = (logp0 + (torch.rand(n, generator=g) - 0.5) * 0.8).tolist()
        self.old = (logp0 + (torch.rand(n, generator=g) - 0.5) * 0.6).tolist()
        samples, start = [], 0
        for k, ((version, versions, reward), length) in enumerate(zip(SPECS, LENGTHS, strict=True)):
            samples.append(
                Sample(
                    prompt_id="p",
                    request_id=f"0/p/{k}",
                    index=k,
                    prompt_ids=PROMPT,
                    response_ids=tuple(self.targets[start : start + length].tolist()),
                    behav_logprobs=tuple(self.behav[start : start + length]),
                    weight_version=version,
                    finish_reason="stop",
                    reward=reward,
                    token_versions=versions,
                )
            )
            start += length
        group = score_group(step=POLICY, prompt_index=0, samples=samples, scoring=GroupScoring())
        self.advantages = group.advantages.tolist()
        self.mb = make_micro_batch([group], policy_version=POLICY)
        self.versions = [v for s in samples for v in s.versions_per_token]


def _logp(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def _trainer_loss(case: Case, settings: LossSettings, *, old_is_policy: bool):
    """The trainer's micro-step loss numerator and its metrics, and d loss / d logits."""
    logits = case.logits.clone().requires_grad_()
    logp = _logp(logits, case.targets)
    old = logp.detach() if old_is_policy else torch.tensor(case.old)
    lp = TriLogprobs(policy=logp, old=old, ref=None, entropy=None, old_is_policy=old_is_policy)
    fake = SimpleNamespace(
        loss=settings,
        device=torch.device("cpu"),
        _numerator=torch.zeros(()),
        _denominator=torch.zeros((), dtype=torch.int64),
        _metrics=None,
    )
    mask = PolicyTrainer._counted(fake, case.mb)
    loss, _ = PolicyTrainer._micro_loss(fake, lp, case.mb, mask, torch.ones((), dtype=torch.int64))
    loss.backward()
    return loss.detach(), logits.grad, fake._metrics


def _clipped(ratio: torch.Tensor, adv: float) -> torch.Tensor:
    """-min(r A, clip(r) A) for one token."""
    return -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * adv)


def _reference(case: Case, kind: str):
    """The loss numerator written out token by token (module doc), and d loss / d logits."""
    logits = case.logits.clone().requires_grad_()
    logp = _logp(logits, case.targets)
    total, n = torch.zeros(()), 0
    for i, length in enumerate(LENGTHS):
        adv, seq = case.advantages[i], torch.zeros(())
        for _ in range(length):
            d = POLICY - case.versions[n]
            behav, old, lp = case.behav[n], case.old[n], logp[n]
            if kind == "loglinear":
                alpha = 1.0 / max(d, 1)
                prox = alpha * behav + (1 - alpha) * lp.detach()
                seq = seq + math.exp(float(prox) - behav) * _clipped(torch.exp(lp - prox), adv)
            elif kind == "recompute":
                dropped = d == 0 and not C_MIN <= math.exp(old - behav) <= C_MAX
                if not dropped:
                    seq = seq + math.exp(old - behav) * _clipped(torch.exp(lp - old), adv)
            else:  # grpo, token_truncate: the ratio only where the engine ran the trainer's weights
                weight = min(max(math.exp(old - behav), C_MIN), C_MAX) if d == 0 else 1.0
                seq = seq + weight * _clipped(torch.exp(lp - old), adv)
            n += 1
        total = total + (seq / length if kind == "grpo" else seq)  # grpo: sequence means summed
    total.backward()
    return total.detach(), logits.grad


SETTINGS = {
    "loglinear": (LossSettings(kind="ppo_decoupled", proximal="loglinear"), True),
    "recompute": (
        LossSettings(
            kind="ppo_decoupled",
            proximal="recompute",
            correction=RolloutCorrection(mode="token_mask", c_min=C_MIN, c_max=C_MAX),
        ),
        False,
    ),
    "grpo": (
        LossSettings(kind="grpo", correction=RolloutCorrection(mode="token_truncate", c_min=C_MIN, c_max=C_MAX)),
        False,
    ),
}


@pytest.mark.parametrize("kind", list(SETTINGS))
def test_the_loss_uses_each_tokens_own_staleness(kind):
    case = Case()
    assert case.mb.token_versions.tolist() == [3, 3, 3, 4, 4, 3, 4, 5, 5, 5, 5, 5]
    settings, old_is_policy = SETTINGS[kind]
    loss, grad, _ = _trainer_loss(case, settings, old_is_policy=old_is_policy)
    want, want_grad = _reference(case, kind)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)
    assert grad.abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["recompute", "grpo"])
def test_mismatch_metrics_count_only_tokens_of_the_current_version(kind):
    """Sample 1 (versions 3, 4, 5, 5) contributes its two version-5 tokens; sample 2 (all at 5) its
    three; sample 0 (3 and 4) none. δ = log π_old − log π_behav on those five tokens."""
    case = Case()
    settings, old_is_policy = SETTINGS[kind]
    _, _, metrics = _trainer_loss(case, settings, old_is_policy=old_is_policy)
    fresh = [n for n, v in enumerate(case.versions) if v == POLICY]
    assert fresh == [7, 8, 9, 10, 11]
    deltas = [case.old[n] - case.behav[n] for n in fresh]
    mismatch = metrics.mismatch
    assert float(mismatch.n_tokens) == 5
    assert float(mismatch.abs_diff_sum) == pytest.approx(sum(abs(x) for x in deltas), rel=1e-5)
    assert float(mismatch.abs_diff_max) == pytest.approx(max(abs(x) for x in deltas), rel=1e-5)
    k3 = sum(math.exp(x) - 1 - x for x in deltas)
    assert float(mismatch.kl_k3_sum) == pytest.approx(k3, rel=1e-4)
    # per sequence: Σ δ over its measured tokens; sample 0 has none
    assert mismatch.seq_measured.tolist() == [False, True, True]
    sums = [deltas[0] + deltas[1], sum(deltas[2:])]
    assert mismatch.seq_log_weights[1:].tolist() == pytest.approx(sums, rel=1e-5)
    if kind == "recompute":
        outside = sum(not C_MIN <= math.exp(x) <= C_MAX for x in deltas)
        assert float(mismatch.n_masked) == outside
