"""Clipped policy-gradient losses: GRPO, BNPO, DAPO, Dr.GRPO and decoupled PPO (A-3PO).

Contract: pure tensor functions, no process groups. Per-token tensors are padded ``[B, L]``
with ``mask [B, L]`` (1 = response token that counts); ``advantages`` are ``[B]``.

Aggregation across micro-batches and DP ranks. Each micro-batch's loss is its numerator
divided by ONE batch-level ``denominator``, so the sum of the micro-batch losses (and the
DP sum of their gradients) is the loss of the whole batch:

====================  ===========================================  ==========================
kind                  numerator (per micro-batch)                  denominator (whole batch)
====================  ===========================================  ==========================
``grpo``              Σ_seq (Σ_t ℓ·m / Σ_t m)  (own length)        number of sequences
``bnpo``, ``dapo``    Σ ℓ·m                                        number of tokens
``dr_grpo``           Σ ℓ·m                                        sequences × max_response_len
``ppo_decoupled``     Σ ℓ·m                                        number of tokens
``distill``           Σ ℓ·m  (ℓ: the reverse-KL term alone)         number of tokens
====================  ===========================================  ==========================

Each row is an entry of ``loss_table.LOSSES`` (with the kind's token term: ``ppo_decoupled``'s
ratio is taken against the proximal policy, the others' against the old one); an unknown kind
is refused naming ``algorithm.loss``.

``loss_denominator`` gives a micro-batch's share of that denominator; it is additive, so the
caller sums it over the batch's micro-batches and all-reduces (SUM) over DP before the first
backward. A sequence counts if it has at least one counted token. ``bnpo`` and ``dapo`` share
the token mean (TRL's ``bnpo`` normalises per micro-batch, its ``dapo`` per generation batch;
both equal this one for a single micro-batch); DAPO's own pieces are ``clip_high`` here and
the data-side functions in ``dapo.py``. The KL and entropy terms are added per token and
aggregated like the policy term (as TRL does for KL; TRL's entropy bonus is always a token
mean); so is the on-policy distillation term (``distill.py``: the reverse KL to a teacher, added
with ``distill_coef`` to any kind, or alone as ``distill``). In ``ppo_decoupled``, ℓ carries the
behaviour weight π_prox / π_behav and tokens the cap drops still count in the denominator (as in
AReaL).

Rollout correction (``correction.py``): whenever ``behav_logp`` is given, the engine's log-
probs are compared with the trainer's for the same weights (``old_logp``, or the detached
policy when it is None) on the tokens sampled by those weights (staleness 0; stale tokens
are not measured, and get no importance ratio: the decoupled behaviour weight owns them; δ
off-policy masking, which needs only π_θ and π_behav, applies to them too; in stale mode the
engine probe, ``trainer.engine_probe``, measures the engine each step) and TRL's
``vllm_importance_sampling_*`` weight multiplies the clipped policy term per token (KL and
entropy terms unweighted, dropped tokens still in the denominator, as TRL). In
``ppo_decoupled`` the behaviour weight stays the one importance weight and the correction
only masks (no double counting; see ``correction.py``). A token whose behaviour log-prob is NaN /
±inf is left out of the loss entirely (every term, every loss kind, stale tokens included), still
in the denominator; ``mismatch/nonfinite_behav`` counts those the correction measures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import chain
from typing import get_args

import torch

from megatron_rl.algorithms.correction import (
    Correction,
    MismatchAlarm,
    RolloutCorrection,
    nonfinite_behav,
    rollout_correction,
)
from megatron_rl.algorithms.distill import DistillTerm, distill_term
from megatron_rl.algorithms.kl import KLEstimator, kl_estimate
from megatron_rl.algorithms.loss_table import Anchor, LossInputs, loss_entry
from megatron_rl.algorithms.metrics import LossMetrics
from megatron_rl.config.fields import raise_found, require_values
from megatron_rl.config.schema import AlgorithmConfig, ClipConfig, KLConfig, LossName, ProximalMode
from megatron_rl.config.sections import clip_rule, decoupled_correction_rule

LossKind = LossName  # the config schema declares each enum once
LOSS_KINDS: tuple[str, ...] = get_args(LossKind)
PROXIMAL_MODES: tuple[str, ...] = get_args(ProximalMode)


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """Everything the loss needs to know, flat (pure tensor math takes no config tree); built from
    ``algorithm`` by ``trainer.from_config``. Defaults are the schema's, never restated here."""

    kind: LossKind = AlgorithmConfig.loss
    clip_low: float = ClipConfig.low  # ratio clipped below at 1 − clip_low
    clip_high: float = ClipConfig.high  # ratio clipped above at 1 + clip_high (DAPO clip-higher: 0.28)
    kl_coef: float = KLConfig.coef  # weight of the per-token KL(π_θ ‖ π_ref) term; 0 = off
    kl_estimator: KLEstimator = KLConfig.estimator
    entropy_coef: float = AlgorithmConfig.entropy_coef  # weight of the entropy bonus (subtracted); 0 = off
    # weight of the reverse-KL-to-teacher term (distill.py); 0 = off. from_config passes distill.coef
    # when distill.teacher is set; kind 'distill' needs it > 0.
    distill_coef: float = 0.0
    proximal: ProximalMode = AlgorithmConfig.proximal  # ppo_decoupled: old-policy forward or A-3PO
    behav_weight_cap: float | None = AlgorithmConfig.behav_weight_cap  # ppo_decoupled: drop π_prox/π_behav > cap
    max_response_len: int | None = None  # dr_grpo: the constant length normaliser
    # Rollout importance-sampling correction (algorithm.rollout_correction); "none" = measure only.
    correction: RolloutCorrection = RolloutCorrection()
    mismatch_alarm: MismatchAlarm | None = None  # gate the trainer applies before the optimizer step

    def __post_init__(self) -> None:
        # the config's own rules on the ``algorithm`` values carried here (flat, under other names)
        require_values(
            {
                "algorithm.loss": self.kind,
                "algorithm.clip.low": self.clip_low,
                "algorithm.clip.high": self.clip_high,
                "algorithm.kl.coef": self.kl_coef,
                "algorithm.kl.estimator": self.kl_estimator,
                "algorithm.entropy_coef": self.entropy_coef,
                "algorithm.proximal": self.proximal,
                "algorithm.behav_weight_cap": self.behav_weight_cap,
            }
        )
        raise_found(
            chain(clip_rule(self.clip_low, self.clip_high), decoupled_correction_rule(self.kind, self.correction.mode))
        )
        if not (self.distill_coef >= 0):
            raise ValueError(f"distill.coef must be >= 0, got {self.distill_coef}")
        if not loss_entry(self.kind).policy_term and self.distill_coef <= 0:
            raise ValueError(f"algorithm.loss={self.kind!r} needs distill.coef > 0 (and distill.teacher set)")
        if loss_entry(self.kind).aggregation.needs_max_response_len and (self.max_response_len or 0) <= 0:
            raise ValueError(
                f"kind={self.kind!r} needs max_response_len > 0 (rollout.sampling.max_new_tokens), "
                f"got {self.max_response_len}"
            )


@dataclass(frozen=True, kw_only=True)
class LossOutput:
    """``loss``: 0-dim, this micro-batch's share of the batch loss (backward on it).
    ``metrics``: its statistics, merge with the other micro-batches'."""

    loss: torch.Tensor
    metrics: LossMetrics


def loss_denominator(settings: LossSettings, mask: torch.Tensor) -> torch.Tensor:
    """This micro-batch's additive share of the batch denominator: a 0-dim int64 count (tokens or
    sequences), exact at any batch size (fp32 is exact only to 2²⁴), on ``mask``'s device.

    ``mask``: ``[B, L]``. Sum the results over all micro-batches of the batch and all DP ranks
    (all-reduce SUM: int64 is among HCCL's all-reduce types, fp64 is not on a 910B), then pass
    the total to every ``policy_loss`` call of that batch.
    """
    return loss_entry(settings.kind).aggregation.denominator(settings, mask.bool())


def policy_loss(
    settings: LossSettings,
    *,
    logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    denominator: torch.Tensor | float,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    behav_logp: torch.Tensor | None = None,
    versions: torch.Tensor | None = None,
    current_version: int | None = None,
    entropy: torch.Tensor | None = None,
    compare_engine: bool = True,
    teacher_logp: torch.Tensor | None = None,
) -> LossOutput:
    """One micro-batch's clipped policy loss; see the module docstring for the aggregation.

    ``logp [B, L]`` policy log-probs (with grad); ``old_logp [B, L]`` detached old-policy
    log-probs (None = on-policy, i.e. ``logp.detach()``); ``ref_logp [B, L]`` needed when
    ``kl_coef > 0``; ``entropy [B, L]`` per-token entropy, needed when ``entropy_coef > 0``
    (metrics only otherwise). ``ppo_decoupled`` also needs ``behav_logp [B, L]`` (rollout
    engine) and, for ``proximal="recompute"``, ``old_logp`` (the proximal forward); for
    ``proximal="loglinear"``, ``versions [B, L]`` and ``current_version`` instead.
    ``advantages [B]``; ``denominator`` from ``loss_denominator``, summed over the batch.
    ``compare_engine=False``: ``old_logp`` (or ``logp``) is not the policy the engine ran (a later
    mini-batch without an old copy): nothing measured (no mode ratio, metrics); δ masking still acts.
    ``teacher_logp [B, L]``: the teacher's log-probs of the sampled tokens, needed (with
    ``behav_logp``) when ``distill_coef > 0`` (``distill.py``).
    """
    inputs = LossInputs(
        logp=logp,
        mask=mask,
        advantages=advantages,
        old_logp=old_logp,
        ref_logp=ref_logp,
        behav_logp=behav_logp,
        versions=versions,
        current_version=current_version,
        entropy=entropy,
        compare_engine=compare_engine,
        teacher_logp=teacher_logp,
    )
    return _micro_batch_loss(settings, inputs, denominator)


def _micro_batch_loss(settings: LossSettings, inputs: LossInputs, denominator: torch.Tensor | float) -> LossOutput:
    """``policy_loss`` on its inputs as one record."""
    _check_shapes(inputs)
    _check_needed(settings, denominator, inputs)
    entry = loss_entry(settings.kind)
    logp, behav_logp = inputs.logp, inputs.behav_logp
    # A NaN / inf engine log-prob is no measurement (correction.py): the token leaves the loss,
    # and the decoupled weight sees a finite stand-in there (the detached policy: weight 1), so
    # nothing non-finite reaches an exp or a gradient.
    unusable = None if behav_logp is None else nonfinite_behav(behav_logp, inputs.mask)
    finite_behav = None if behav_logp is None else torch.where(unusable, logp.detach(), behav_logp)
    anchor = entry.token_term.anchor(settings, inputs, finite_behav)
    correction = None if behav_logp is None else _engine_correction(settings, inputs)
    counted = inputs.mask.bool()
    loss_tokens = counted if anchor.behav is None else anchor.behav.kept
    if unusable is not None:
        loss_tokens = loss_tokens & ~unusable
    factor = None if correction is None else entry.token_term.correction_factor(correction)
    terms = _token_terms(settings, inputs, anchor, factor)
    masked = torch.where(loss_tokens, terms.per_token, torch.zeros_like(terms.per_token))
    loss = entry.aggregation.numerator(masked, counted) / denominator
    metrics = _metrics(settings, inputs, anchor, terms, loss_tokens)
    if correction is not None:
        metrics = replace(metrics, mismatch=correction.metrics)
    return LossOutput(loss=loss.to(logp.dtype), metrics=metrics)


def _engine_correction(settings: LossSettings, inputs: LossInputs) -> Correction:
    """The rollout correction against the engine. Only tokens sampled by the weights the trainer
    holds as old_logp (staleness 0) have a same-weights comparison (the mode's ratio, the
    metrics); stale tokens (stale mode, d >= 1) get δ masking (it needs only π_θ and π_behav)
    and are otherwise left to the behaviour weight."""
    mask, versions = inputs.mask, inputs.versions
    fresh = mask.bool() & inputs.compare_engine
    if versions is not None and inputs.current_version is not None:
        fresh = fresh & (versions == inputs.current_version)
    return rollout_correction(
        settings.correction,
        trainer_logp=inputs.logp if inputs.old_logp is None else inputs.old_logp,
        behav_logp=inputs.behav_logp,
        logp=inputs.logp,
        advantages=inputs.advantages,
        mask=mask,
        measured=fresh,
    )


@dataclass(frozen=True)
class _TokenTerms:
    per_token: torch.Tensor  # [B, L] loss of each token before masking and aggregation
    ratio: torch.Tensor  # [B, L] π_θ / anchor (1 on padding)
    adv: torch.Tensor  # [B, 1] advantages in logp's dtype
    kl_ref: torch.Tensor | None  # [B, L] KL estimate to the reference, if given
    distill: DistillTerm | None  # the reverse-KL-to-teacher term, when distill_coef > 0


def _token_terms(
    settings: LossSettings, inputs: LossInputs, anchor: Anchor, correction_factor: torch.Tensor | None
) -> _TokenTerms:
    """Clipped surrogate × behaviour weight × the kind's correction factor, + KL and entropy terms."""
    logp, counted = inputs.logp, inputs.mask.bool()
    adv = inputs.advantages.to(logp.dtype).unsqueeze(-1)  # [B, 1], broadcast over tokens
    # Padding gets log-ratio 0 (and ref = logp below): garbage there must not reach an exp,
    # where an inf would turn the zero upstream gradient into nan.
    ratio = torch.exp(torch.where(counted, logp - anchor.logp, torch.zeros_like(logp)))
    clipped = torch.clamp(ratio, 1.0 - settings.clip_low, 1.0 + settings.clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if not loss_entry(settings.kind).policy_term:
        per_token = torch.zeros_like(per_token)
    if anchor.behav is not None:
        per_token = per_token * anchor.behav.weight
    if correction_factor is not None:
        per_token = per_token * correction_factor.to(per_token.dtype)
    kl_ref = None
    if inputs.ref_logp is not None:
        kl_ref = kl_estimate(logp, torch.where(counted, inputs.ref_logp, logp.detach()), settings.kl_estimator)
    if settings.kl_coef > 0:
        per_token = per_token + settings.kl_coef * kl_ref
    if settings.entropy_coef > 0:
        per_token = per_token - settings.entropy_coef * inputs.entropy
    distill = None
    if settings.distill_coef > 0:
        distill = distill_term(ratio, inputs.behav_logp, inputs.teacher_logp, counted, settings.distill_coef)
        per_token = per_token + distill.per_token
    return _TokenTerms(per_token=per_token, ratio=ratio, adv=adv, kl_ref=kl_ref, distill=distill)


def _check_shapes(inputs: LossInputs) -> None:
    logp = inputs.logp
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, L], got shape {tuple(logp.shape)}")
    names = ("mask", "old_logp", "ref_logp", "behav_logp", "versions", "entropy", "teacher_logp")
    for name in names:
        t = getattr(inputs, name)
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if inputs.advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B={logp.shape[0]}], got {tuple(inputs.advantages.shape)}")


def _check_needed(settings: LossSettings, denominator: torch.Tensor | float, inputs: LossInputs) -> None:
    if isinstance(denominator, (int, float)) and denominator <= 0:
        raise ValueError(f"denominator must be > 0, got {denominator}")
    if settings.kl_coef > 0 and inputs.ref_logp is None:
        raise ValueError(f"kl_coef={settings.kl_coef} > 0 needs ref_logp")
    if settings.entropy_coef > 0 and inputs.entropy is None:
        raise ValueError(f"entropy_coef={settings.entropy_coef} > 0 needs entropy")
    if settings.distill_coef > 0 and (inputs.teacher_logp is None or inputs.behav_logp is None):
        raise ValueError(f"distill_coef={settings.distill_coef} > 0 needs teacher_logp and behav_logp")


@torch.no_grad()
def _metrics(
    settings: LossSettings, inputs: LossInputs, anchor: Anchor, terms: _TokenTerms, tokens: torch.Tensor
) -> LossMetrics:
    """The micro-batch's statistics over ``tokens`` (those in the loss)."""

    def total(x: torch.Tensor) -> torch.Tensor:
        return torch.where(tokens, x, torch.zeros_like(x)).sum().float()

    def peak(x: torch.Tensor) -> torch.Tensor:
        return torch.where(tokens, x, torch.zeros_like(x)).max().float()

    ratio, behav, entropy, distill = terms.ratio, anchor.behav, inputs.entropy, terms.distill
    low = (ratio < 1.0 - settings.clip_low) & (terms.adv < 0)
    high = (ratio > 1.0 + settings.clip_high) & (terms.adv > 0)
    return LossMetrics(
        n_tokens=tokens.sum().float(),
        n_clip_low=total(low.to(ratio.dtype)),
        n_clip_high=total(high.to(ratio.dtype)),
        ratio_sum=total(ratio),
        ratio_max=peak(ratio),
        approx_kl_sum=total(kl_estimate(anchor.logp, inputs.logp.detach(), "k3")),
        kl_ref_sum=None if terms.kl_ref is None else total(terms.kl_ref),
        entropy_sum=None if entropy is None else total(entropy),
        behav_weight_sum=None if behav is None else total(behav.weight),
        behav_weight_max=None if behav is None else peak(behav.weight),
        n_capped=None if behav is None else behav.n_capped.float(),
        distill_kl_sum=None if distill is None else total(distill.reverse_kl),
        distill_tokens=None if distill is None else (distill.covered & tokens).sum().float(),
    )
