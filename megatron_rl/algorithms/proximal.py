"""Proximal policy for decoupled PPO: A-3PO log-linear interpolation and the behaviour weight.

Contract: pure tensor functions. Decoupled PPO (Hilton et al. 2022; AReaL) separates the
off-policy correction π_prox / π_behav (a detached per-token weight) from the trust region
π_θ / π_prox (clipped). ``proximal: recompute`` gets log π_prox from an old-policy forward;
``proximal: loglinear`` (A-3PO, "Staleness-aware Proximal Policy Approximation") skips it:

    log π_prox = α · log π_behav + (1 − α) · log π_θ.detach(),   α = 1 / max(d, 1),

with d = current_version − version that generated the token. This follows AReaL's
``compute_prox_logp_approximations`` (weight (v_prox − v_behav) / (v_θ − v_behav) on π_θ with
v_prox = v_θ − 1, i.e. (d − 1) / d, and 0 at d = 0). At d = 0 π_prox = π_behav, which is
standard PPO against the behaviour policy. The paper's summary says "α = 0 at d = 0"; that
agrees only while π_θ = π_behav (first mini-batch), so the reference implementation is
followed. Since α ∈ (0, 1], π_prox lies between π_behav and π_θ per token (sandwich).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def staleness_alpha(versions: torch.Tensor, current_version: int) -> torch.Tensor:
    """Interpolation weight α = 1 / max(d, 1) on log π_behav, d = current_version − versions.

    ``versions``: ``[B, L]`` int, the weight version that generated each token. Positions
    that do not count (padding, prompt) may hold anything, e.g. −1; the caller masks them.
    Returns ``[B, L]`` float32 in (0, 1]. Versions newer than ``current_version`` on counted
    tokens are the caller's bug; ``loglinear_proximal_logp`` checks them under a mask.
    """
    d = (current_version - versions).to(torch.float32)
    return 1.0 / d.clamp(min=1.0)


def loglinear_proximal_logp(
    behav_logp: torch.Tensor,
    logp: torch.Tensor,
    versions: torch.Tensor,
    current_version: int,
    mask: torch.Tensor,
) -> torch.Tensor:
    """A-3PO log π_prox = α·log π_behav + (1 − α)·log π_θ.detach(), all ``[B, L]``.

    ``logp`` is detached here: the proximal policy is an anchor, never a gradient path.
    Raises ``ValueError`` if a counted token (``mask``) has a version after
    ``current_version``.
    """
    if versions.shape != logp.shape:
        raise ValueError(f"versions shape {tuple(versions.shape)} != logp {tuple(logp.shape)}")
    if bool(((versions > current_version) & mask.bool()).any()):
        raise ValueError(
            f"versions hold a version newer than current_version={current_version} "
            f"(max {int(versions[mask.bool()].max())}); staleness cannot be negative"
        )
    alpha = staleness_alpha(versions, current_version).to(logp.dtype)
    return alpha * behav_logp + (1.0 - alpha) * logp.detach()


@dataclass(frozen=True, kw_only=True)
class BehaviourWeight:
    """The detached off-policy correction of decoupled PPO, per token.

    ``weight``: ``[B, L]`` π_prox / π_behav, 0 where the token is dropped. ``kept``: ``[B, L]``
    bool, counted tokens whose weight is within the cap. ``n_capped``: 0-dim count of counted
    tokens dropped by the cap.
    """

    weight: torch.Tensor
    kept: torch.Tensor
    n_capped: torch.Tensor


def behaviour_weight(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, cap: float | None
) -> BehaviourWeight:
    """π_prox / π_behav per token, tokens over ``cap`` masked out (AReaL's "mask" mode).

    All tensors ``[B, L]``; the result is detached. ``cap=None`` keeps every token.
    """
    weight = torch.exp(prox_logp.detach() - behav_logp.detach())
    counted = mask.bool()
    kept = counted if cap is None else counted & (weight <= cap)
    return BehaviourWeight(
        weight=torch.where(kept, weight, torch.zeros_like(weight)),
        kept=kept,
        n_capped=(counted & ~kept).sum(),
    )
