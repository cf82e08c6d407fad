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
====================  ===========================================  ==========================

``loss_denominator`` gives a micro-batch's share of that denominator; it is additive, so the
caller sums it over the batch's micro-batches and all-reduces (SUM) over DP before the first
backward. A sequence counts if it has at least one counted token. ``bnpo`` and ``dapo`` share
the token mean (TRL's ``bnpo`` normalises per micro-batch, its ``dapo`` per generation batch;
both equal this one for a single micro-batch); DAPO's own pieces are ``clip_high`` here and
the data-side functions in ``dapo.py``. The KL and entropy terms are added per token and
aggregated like the policy term (as TRL does for KL; TRL's entropy bonus is always a token
mean). In ``ppo_decoupled``, ℓ carries the behaviour weight π_prox / π_behav and tokens the
cap drops still count in the denominator (as in AReaL).

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
from megatron_rl.algorithms.kl import KLEstimator, kl_estimate
from megatron_rl.algorithms.metrics import LossMetrics
from megatron_rl.algorithms.proximal import (
    BehaviourWeight,
    behaviour_weight,
    loglinear_proximal_logp,
)
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
        if self.kind == "dr_grpo" and (self.max_response_len or 0) <= 0:
            raise ValueError(
                f"kind='dr_grpo' needs max_response_len > 0 (rollout.sampling.max_new_tokens), "
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
    counted = mask.bool()
    n_seqs = counted.any(dim=-1).sum(dtype=torch.int64)
    if settings.kind == "grpo":
        return n_seqs
    if settings.kind == "dr_grpo":
        return n_seqs * settings.max_response_len
    return counted.sum(dtype=torch.int64)


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
    """
    _check_shapes(logp, mask, advantages, old_logp, ref_logp, behav_logp, versions, entropy)
    _check_needed(settings, denominator, ref_logp, entropy)
    # A NaN / inf engine log-prob is no measurement (correction.py): the token leaves the loss,
    # and the decoupled weight sees a finite stand-in there (the detached policy: weight 1), so
    # nothing non-finite reaches an exp or a gradient.
    unusable = None if behav_logp is None else nonfinite_behav(behav_logp, mask)
    finite_behav = None if behav_logp is None else torch.where(unusable, logp.detach(), behav_logp)
    anchor, behav = _anchor_and_behaviour(settings, logp, mask, old_logp, finite_behav, versions, current_version)
    correction = None
    if behav_logp is not None:
        correction = _engine_correction(
            settings, logp, old_logp, behav_logp, advantages, mask, versions, current_version, compare_engine
        )
    counted = mask.bool()
    loss_tokens = counted if behav is None else behav.kept
    if unusable is not None:
        loss_tokens = loss_tokens & ~unusable
    terms = _token_terms(settings, logp, anchor, counted, advantages, behav, correction, ref_logp, entropy)
    loss = _numerator(settings, terms.per_token, loss_tokens, counted) / denominator
    metrics = _metrics(settings, terms.ratio, terms.adv, anchor, logp, loss_tokens, terms.kl_ref, entropy, behav)
    if correction is not None:
        metrics = replace(metrics, mismatch=correction.metrics)
    return LossOutput(loss=loss.to(logp.dtype), metrics=metrics)


def _engine_correction(
    settings: LossSettings,
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    versions: torch.Tensor | None,
    current_version: int | None,
    compare_engine: bool = True,
) -> Correction:
    """The rollout correction against the engine. Only tokens sampled by the weights the trainer
    holds as old_logp (staleness 0) have a same-weights comparison (the mode's ratio, the
    metrics); stale tokens (stale mode, d >= 1) get δ masking (it needs only π_θ and π_behav)
    and are otherwise left to the behaviour weight."""
    fresh = mask.bool() & compare_engine
    if versions is not None and current_version is not None:
        fresh = fresh & (versions == current_version)
    return rollout_correction(
        settings.correction,
        trainer_logp=logp if old_logp is None else old_logp,
        behav_logp=behav_logp,
        logp=logp,
        advantages=advantages,
        mask=mask,
        measured=fresh,
    )


@dataclass(frozen=True)
class _TokenTerms:
    per_token: torch.Tensor  # [B, L] loss of each token before masking and aggregation
    ratio: torch.Tensor  # [B, L] π_θ / anchor (1 on padding)
    adv: torch.Tensor  # [B, 1] advantages in logp's dtype
    kl_ref: torch.Tensor | None  # [B, L] KL estimate to the reference, if given


def _token_terms(
    settings: LossSettings,
    logp: torch.Tensor,
    anchor: torch.Tensor,
    counted: torch.Tensor,
    advantages: torch.Tensor,
    behav: BehaviourWeight | None,
    correction: Correction | None,
    ref_logp: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> _TokenTerms:
    """Clipped surrogate × behaviour weight × correction factor, + KL and entropy terms."""
    adv = advantages.to(logp.dtype).unsqueeze(-1)  # [B, 1], broadcast over tokens
    # Padding gets log-ratio 0 (and ref = logp below): garbage there must not reach an exp,
    # where an inf would turn the zero upstream gradient into nan.
    ratio = torch.exp(torch.where(counted, logp - anchor, torch.zeros_like(logp)))
    clipped = torch.clamp(ratio, 1.0 - settings.clip_low, 1.0 + settings.clip_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if behav is not None:
        per_token = per_token * behav.weight
    if correction is not None:
        per_token = per_token * _correction_factor(settings, correction).to(per_token.dtype)
    kl_ref = None
    if ref_logp is not None:
        kl_ref = kl_estimate(logp, torch.where(counted, ref_logp, logp.detach()), settings.kl_estimator)
    if settings.kl_coef > 0:
        per_token = per_token + settings.kl_coef * kl_ref
    if settings.entropy_coef > 0:
        per_token = per_token - settings.entropy_coef * entropy
    return _TokenTerms(per_token=per_token, ratio=ratio, adv=adv, kl_ref=kl_ref)


def _check_shapes(
    logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *per_token: torch.Tensor | None
) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, L], got shape {tuple(logp.shape)}")
    names = ("old_logp", "ref_logp", "behav_logp", "versions", "entropy")
    for name, t in zip(("mask",) + names, (mask,) + per_token, strict=True):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B={logp.shape[0]}], got {tuple(advantages.shape)}")


def _check_needed(
    settings: LossSettings,
    denominator: torch.Tensor | float,
    ref_logp: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> None:
    if isinstance(denominator, (int, float)) and denominator <= 0:
        raise ValueError(f"denominator must be > 0, got {denominator}")
    if settings.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={settings.kl_coef} > 0 needs ref_logp")
    if settings.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={settings.entropy_coef} > 0 needs entropy")


def _anchor_and_behaviour(
    settings: LossSettings,
    logp: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor | None,
    behav_logp: torch.Tensor | None,
    versions: torch.Tensor | None,
    current_version: int | None,
) -> tuple[torch.Tensor, BehaviourWeight | None]:
    """The detached log-probs the ratio is taken against, and the behaviour weight if any."""
    if settings.kind != "ppo_decoupled":
        return (logp.detach() if old_logp is None else old_logp.detach()), None
    if behav_logp is None:
        raise ValueError("kind='ppo_decoupled' needs behav_logp (from the rollout engine)")
    if settings.proximal == "recompute":
        if old_logp is None:
            raise ValueError("proximal='recompute' needs old_logp (the proximal forward)")
        prox = old_logp.detach()
    else:
        if versions is None or current_version is None:
            raise ValueError("proximal='loglinear' needs versions and current_version")
        prox = loglinear_proximal_logp(behav_logp, logp, versions, current_version, mask)
    return prox, behaviour_weight(prox, behav_logp, mask, settings.behav_weight_cap)


def _correction_factor(settings: LossSettings, correction: Correction) -> torch.Tensor:
    """TRL's weight; for ppo_decoupled only its keep-mask (the behaviour weight is the weight)."""
    if settings.kind == "ppo_decoupled":
        return (~correction.dropped).to(correction.weight.dtype)
    return correction.weight


def _numerator(
    settings: LossSettings, per_token: torch.Tensor, loss_tokens: torch.Tensor, counted: torch.Tensor
) -> torch.Tensor:
    masked = torch.where(loss_tokens, per_token, torch.zeros_like(per_token))
    if settings.kind == "grpo":  # per-sequence token mean with the sequence's own length
        lengths = counted.sum(dim=-1).clamp(min=1).to(per_token.dtype)
        return (masked.sum(dim=-1) / lengths).sum()
    return masked.sum()


@torch.no_grad()
def _metrics(
    settings: LossSettings,
    ratio: torch.Tensor,
    adv: torch.Tensor,
    anchor: torch.Tensor,
    logp: torch.Tensor,
    tokens: torch.Tensor,
    kl_ref: torch.Tensor | None,
    entropy: torch.Tensor | None,
    behav: BehaviourWeight | None,
) -> LossMetrics:
    def total(x: torch.Tensor) -> torch.Tensor:
        return torch.where(tokens, x, torch.zeros_like(x)).sum().float()

    def peak(x: torch.Tensor) -> torch.Tensor:
        return torch.where(tokens, x, torch.zeros_like(x)).max().float()

    low = (ratio < 1.0 - settings.clip_low) & (adv < 0)
    high = (ratio > 1.0 + settings.clip_high) & (adv > 0)
    return LossMetrics(
        n_tokens=tokens.sum().float(),
        n_clip_low=total(low.to(ratio.dtype)),
        n_clip_high=total(high.to(ratio.dtype)),
        ratio_sum=total(ratio),
        ratio_max=peak(ratio),
        approx_kl_sum=total(kl_estimate(anchor, logp.detach(), "k3")),
        kl_ref_sum=None if kl_ref is None else total(kl_ref),
        entropy_sum=None if entropy is None else total(entropy),
        behav_weight_sum=None if behav is None else total(behav.weight),
        behav_weight_max=None if behav is None else peak(behav.weight),
        n_capped=None if behav is None else behav.n_capped.float(),
    )
