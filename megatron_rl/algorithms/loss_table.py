"""The loss table: what each ``algorithm.loss`` kind does differently, one entry per kind.

An entry is a ``TokenTerm`` (what the clipped ratio is taken against, and what the rollout
correction contributes to a token's policy term) and an ``Aggregation`` (a micro-batch's
numerator and its additive share of the batch denominator; ``losses.py`` has the table of
formulas). Everything else, the clipped surrogate, the KL and entropy terms and the metrics, is
the same for every kind and lives in ``losses.py``. ``LossInputs`` carries one micro-batch's
tensors from ``policy_loss`` to the entry's functions.

Contract: pure tensor functions, no process groups; per-token tensors ``[B, L]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_rl.algorithms.correction import Correction
from megatron_rl.algorithms.proximal import BehaviourWeight, behaviour_weight, loglinear_proximal_logp

if TYPE_CHECKING:
    from megatron_rl.algorithms.losses import LossSettings


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    """One micro-batch's tensors, as ``policy_loss`` documents them (its defaults are the only ones)."""

    logp: torch.Tensor  # [B, L] policy log-probs, with grad
    mask: torch.Tensor  # [B, L] 1 = response token that counts
    advantages: torch.Tensor  # [B]
    old_logp: torch.Tensor | None  # [B, L] detached old policy; None = on-policy
    ref_logp: torch.Tensor | None  # [B, L] reference, for the KL term
    behav_logp: torch.Tensor | None  # [B, L] rollout engine
    versions: torch.Tensor | None  # [B, L] policy version that sampled each token
    current_version: int | None
    entropy: torch.Tensor | None  # [B, L] policy entropy, with grad
    compare_engine: bool  # old_logp (or logp) is the policy the engine ran
    teacher_logp: torch.Tensor | None = None  # [B, L] teacher log-probs of the sampled tokens (distill.py)


@dataclass(frozen=True, kw_only=True)
class Anchor:
    """The detached log-probs ``[B, L]`` the ratio is taken against, and the behaviour weight if any."""

    logp: torch.Tensor
    behav: BehaviourWeight | None


@dataclass(frozen=True, kw_only=True)
class TokenTerm:
    """How a kind weighs a token's clipped policy term. ``anchor(settings, inputs, finite_behav)``:
    the ratio's anchor (``finite_behav``: ``behav_logp`` with unusable tokens replaced, or None);
    ``correction_factor(correction)``: the ``[B, L]`` factor the rollout correction multiplies in."""

    anchor: Callable[[LossSettings, LossInputs, torch.Tensor | None], Anchor]
    correction_factor: Callable[[Correction], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Aggregation:
    """``numerator(masked, counted)``: a micro-batch's sum of the masked per-token loss ``[B, L]``;
    ``denominator(settings, counted)``: its 0-dim int64 share of the batch denominator."""

    numerator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    denominator: Callable[[LossSettings, torch.Tensor], torch.Tensor]
    needs_max_response_len: bool = False  # the denominator's constant length (LossSettings checks it)


@dataclass(frozen=True, kw_only=True)
class LossEntry:
    """One ``algorithm.loss`` kind: its token term and its aggregation. ``policy_term`` False:
    no clipped surrogate (``distill``: the reverse-KL term to the teacher is the whole loss)."""

    token_term: TokenTerm
    aggregation: Aggregation
    policy_term: bool = True


def _old_policy_anchor(settings: LossSettings, inputs: LossInputs, finite_behav: torch.Tensor | None) -> Anchor:
    """The old policy (the detached policy when it is None); no behaviour weight."""
    old = inputs.old_logp
    return Anchor(logp=(inputs.logp.detach() if old is None else old.detach()), behav=None)


def _proximal_anchor(settings: LossSettings, inputs: LossInputs, finite_behav: torch.Tensor | None) -> Anchor:
    """Decoupled PPO: the proximal policy (recomputed or A-3PO's log-linear one) and π_prox / π_behav."""
    if finite_behav is None:
        raise ValueError("kind='ppo_decoupled' needs behav_logp (from the rollout engine)")
    if settings.proximal == "recompute":
        if inputs.old_logp is None:
            raise ValueError("proximal='recompute' needs old_logp (the proximal forward)")
        prox = inputs.old_logp.detach()
    else:
        if inputs.versions is None or inputs.current_version is None:
            raise ValueError("proximal='loglinear' needs versions and current_version")
        prox = loglinear_proximal_logp(finite_behav, inputs.logp, inputs.versions, inputs.current_version, inputs.mask)
    return Anchor(logp=prox, behav=behaviour_weight(prox, finite_behav, inputs.mask, settings.behav_weight_cap))


def _importance_weight(correction: Correction) -> torch.Tensor:
    """TRL's weight."""
    return correction.weight


def _keep_mask(correction: Correction) -> torch.Tensor:
    """Only the correction's keep-mask: the behaviour weight is the importance weight."""
    return (~correction.dropped).to(correction.weight.dtype)


def _sum_of_sequence_means(masked: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """Per-sequence token mean with the sequence's own length, summed over sequences."""
    lengths = counted.sum(dim=-1).clamp(min=1).to(masked.dtype)
    return (masked.sum(dim=-1) / lengths).sum()


def _token_sum(masked: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """Σ ℓ·m over every token."""
    return masked.sum()


def _sequences(settings: LossSettings, counted: torch.Tensor) -> torch.Tensor:
    """Sequences with at least one counted token."""
    return counted.any(dim=-1).sum(dtype=torch.int64)


def _sequences_times_length(settings: LossSettings, counted: torch.Tensor) -> torch.Tensor:
    """Sequences × max_response_len (Dr.GRPO's constant normaliser)."""
    return _sequences(settings, counted) * settings.max_response_len


def _tokens(settings: LossSettings, counted: torch.Tensor) -> torch.Tensor:
    """Counted tokens."""
    return counted.sum(dtype=torch.int64)


CLIPPED = TokenTerm(anchor=_old_policy_anchor, correction_factor=_importance_weight)
DECOUPLED = TokenTerm(anchor=_proximal_anchor, correction_factor=_keep_mask)
SEQUENCE_MEAN = Aggregation(numerator=_sum_of_sequence_means, denominator=_sequences)
TOKEN_MEAN = Aggregation(numerator=_token_sum, denominator=_tokens)
CONSTANT_LENGTH = Aggregation(numerator=_token_sum, denominator=_sequences_times_length, needs_max_response_len=True)

LOSSES: dict[str, LossEntry] = {
    "grpo": LossEntry(token_term=CLIPPED, aggregation=SEQUENCE_MEAN),
    "bnpo": LossEntry(token_term=CLIPPED, aggregation=TOKEN_MEAN),
    "dapo": LossEntry(token_term=CLIPPED, aggregation=TOKEN_MEAN),
    "dr_grpo": LossEntry(token_term=CLIPPED, aggregation=CONSTANT_LENGTH),
    "ppo_decoupled": LossEntry(token_term=DECOUPLED, aggregation=TOKEN_MEAN),
    "distill": LossEntry(token_term=CLIPPED, aggregation=TOKEN_MEAN, policy_term=False),
}


def loss_entry(kind: str) -> LossEntry:
    """The table's entry for ``kind`` (the ``algorithm.loss`` value); a clear error for an unknown one."""
    try:
        return LOSSES[kind]
    except KeyError:
        known = ", ".join(repr(k) for k in LOSSES)
        raise ValueError(f"algorithm.loss: unknown loss kind {kind!r}; expected one of {known}") from None
