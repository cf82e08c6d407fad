"""Per-token KL estimators (Schulman's k1 / k2 / k3) between two policies.

Contract: pure tensor functions. ``kl_estimate(log_p, log_q, ...)`` estimates KL(p ‖ q) from
tokens sampled from p, elementwise; masking and aggregation are the caller's.
Source: J. Schulman, "Approximating KL Divergence" (2020), with r = q(x) / p(x):
k1 = −log r (unbiased, high variance), k2 = ½ (log r)² (biased, low variance),
k3 = (r − 1) − log r (unbiased, non-negative).
"""

from __future__ import annotations

from typing import get_args

import torch

from megatron_rl.config.schema import KLEstimator

KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)


def kl_estimate(log_p: torch.Tensor, log_q: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(p ‖ q) from samples of p.

    ``log_p``, ``log_q``: ``[...]`` log-probabilities of the sampled tokens under p and q
    (same shape). Returns a tensor of that shape. Gradients flow through both arguments.
    For the KL of the policy to the reference, p = policy and q = reference (what TRL's GRPO
    calls ``per_token_kl`` for k3).
    """
    if log_p.shape != log_q.shape:
        raise ValueError(f"log_p shape {tuple(log_p.shape)} != log_q shape {tuple(log_q.shape)}")
    log_r = log_q - log_p
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
