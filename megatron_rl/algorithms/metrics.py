"""Loss statistics that aggregate exactly across micro-batches and data-parallel ranks.

Contract: ``LossMetrics`` holds detached 0-dim tensors that are either sums (combine by
adding) or maxima (combine by max), never per-micro-batch means, so merging the metrics of a
batch's micro-batches in any split gives the whole-batch statistics. Across ranks the trainer
merges every replica's last-stage metrics the same way (``trainer.world_metrics``; this module
holds no process group). Token statistics are over the tokens that enter the loss (mask minus tokens
dropped by the behaviour-weight cap); ``n_capped`` counts the dropped ones. ``mismatch``
(engine vs trainer log-probs, ``correction.MismatchMetrics``) is over all counted tokens and
merges the same way; it is logged under ``mismatch/``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from megatron_rl.algorithms.correction import MismatchMetrics

SUM_FIELDS = (
    "n_tokens",
    "n_clip_low",
    "n_clip_high",
    "ratio_sum",
    "approx_kl_sum",
    "kl_ref_sum",
    "entropy_sum",
    "behav_weight_sum",
    "n_capped",
    "distill_kl_sum",
    "distill_tokens",
)
MAX_FIELDS = ("ratio_max", "behav_weight_max")


@dataclass(frozen=True, kw_only=True)
class LossMetrics:
    """Sums and maxima over the loss tokens of one or more micro-batches (0-dim tensors).

    Optional fields are None when their input was absent (no reference log-probs, no
    entropy, not a decoupled loss).
    """

    n_tokens: torch.Tensor  # tokens entering the loss
    n_clip_low: torch.Tensor  # ratio < 1 − clip_low with A < 0 (clip active)
    n_clip_high: torch.Tensor  # ratio > 1 + clip_high with A > 0 (clip active)
    ratio_sum: torch.Tensor  # importance weight π_θ / π_old (or / π_prox)
    ratio_max: torch.Tensor
    approx_kl_sum: torch.Tensor  # k3 estimate of KL(π_old ‖ π_θ)
    kl_ref_sum: torch.Tensor | None = None  # KL(π_θ ‖ π_ref), the configured estimator
    entropy_sum: torch.Tensor | None = None
    behav_weight_sum: torch.Tensor | None = None  # π_prox / π_behav, decoupled only
    behav_weight_max: torch.Tensor | None = None
    n_capped: torch.Tensor | None = None  # counted tokens dropped by behav_weight_cap
    mismatch: MismatchMetrics | None = None  # engine vs trainer log-probs (given behav_logp)
    distill_kl_sum: torch.Tensor | None = None  # Σ log π_behav − log π_teacher over covered loss tokens
    distill_tokens: torch.Tensor | None = None  # loss tokens the teacher covered (finite log-probs)

    def merge(self, other: LossMetrics) -> LossMetrics:
        """Statistics of the union of both token sets (sums added, maxima maxed). ``mismatch``
        counts its own tokens, so a side that measured none (None) adds nothing to it."""
        merged = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "mismatch" and (a is None or b is None):
                merged[f.name] = a if b is None else b
                continue
            if (a is None) != (b is None):
                raise ValueError(f"cannot merge LossMetrics: {f.name} is set on one side only")
            if f.name == "mismatch" and a is not None:
                merged[f.name] = a.merge(b)
            elif a is not None:
                merged[f.name] = torch.maximum(a, b) if f.name in MAX_FIELDS else a + b
        return replace(self, **merged)

    def to_log(self, prefix: str = "loss/") -> dict[str, float]:
        """Means and maxima as plain floats for the metrics logger (syncs with the device)."""
        n = max(float(self.n_tokens), 1.0)
        out = {
            "n_tokens": float(self.n_tokens),
            "clip_frac_low": float(self.n_clip_low) / n,
            "clip_frac_high": float(self.n_clip_high) / n,
            "ratio_mean": float(self.ratio_sum) / n,
            "ratio_max": float(self.ratio_max),
            "approx_kl_old": float(self.approx_kl_sum) / n,
        }
        if self.kl_ref_sum is not None:
            out["kl_ref"] = float(self.kl_ref_sum) / n
        if self.entropy_sum is not None:
            out["entropy"] = float(self.entropy_sum) / n
        if self.behav_weight_sum is not None:
            out["behav_weight_mean"] = float(self.behav_weight_sum) / n
            out["behav_weight_max"] = float(self.behav_weight_max)
            out["n_capped"] = float(self.n_capped)
        out = {prefix + k: v for k, v in out.items()}
        if self.mismatch is not None:
            out.update(self.mismatch.to_log())
        if self.distill_tokens is not None:  # the reverse KL to the teacher (distill.py), per covered token
            out["distill/kl"] = float(self.distill_kl_sum) / max(float(self.distill_tokens), 1.0)
            out["distill/tokens"] = float(self.distill_tokens)
        return out
