"""On-policy distillation: the per-token reverse KL to a teacher, as a policy-gradient term.

The student samples y_t; a teacher scores the same tokens (teacher-forced log-probs,
``pipeline.teacher``). The sampled-token estimator of the reverse KL KL(π_student ‖ π_teacher)
at token t is

    k_t = log π_behav(y_t) − log π_teacher(y_t)

(π_behav: the student weights that sampled y_t, as the rollout engine reported them). It is
used as a per-token negative advantage with the importance-sampling policy-gradient estimator,
discount 0 (no sum over later tokens):

    ℓ_t = coef · r_t · sg(k_t),     r_t = π_θ(y_t) / π_anchor(y_t)

so ∇ℓ_t = coef · k_t · ∇log π_θ(y_t) at r_t = 1. This is the form of Thinking Machines'
"On-Policy Distillation" (K. Lu et al., 2025, thinkingmachines.ai/blog/on-policy-distillation)
and of the Tinker cookbook (``tinker_cookbook/distillation/train_on_policy.py``,
``incorporate_kl_penalty``: advantages += −kl_penalty_coef · mask · (sampled_logprobs −
teacher_logprobs), ``kl_discount_factor`` 0, trained with the ``importance_sampling`` loss
−(exp(log π_θ − log π_sampler) · A)). Differences: the ratio r_t here is the loss kind's own
(π_θ / π_old, or / π_prox for ``ppo_decoupled``; the engine's mismatch is the rollout
correction's business, not this term's), unclipped as Tinker's; the term is added per token
and aggregated like the policy term (``losses.py``), unweighted by the rollout correction,
like the KL-to-reference term.

``algorithm.loss: distill`` is the term alone (no reward, no advantage: token mean); any
other kind with ``distill.teacher`` set adds it with weight ``distill.coef``. A token counts
only where the loss mask holds (multi-turn observations never do) and both the behaviour and
the teacher log-prob are finite; elsewhere k_t is 0 (never NaN, so no NaN reaches a gradient).

Contract: pure tensor functions, per-token tensors ``[B, L]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class DistillTerm:
    """The distillation term of one micro-batch, per token ``[B, L]``."""

    per_token: torch.Tensor  # coef · r_t · sg(k_t), 0 where not covered
    reverse_kl: torch.Tensor  # k_t (detached), 0 where not covered
    covered: torch.Tensor  # bool: counted token with a finite behaviour and teacher log-prob


def teacher_coverage(mask: torch.Tensor, behav_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` bool: the tokens the distillation term sees (counted, both log-probs finite)."""
    return mask.bool() & torch.isfinite(behav_logp) & torch.isfinite(teacher_logp)


def distill_term(
    ratio: torch.Tensor, behav_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, coef: float
) -> DistillTerm:
    """The per-token distillation term (module docstring) from the kind's ratio ``r_t`` (with
    grad), the behaviour and teacher log-probs of the sampled tokens and the counted ``mask``."""
    covered = teacher_coverage(mask, behav_logp, teacher_logp)
    diff = (behav_logp - teacher_logp).detach().to(ratio.dtype)
    reverse_kl = torch.where(covered, diff, torch.zeros_like(diff))
    return DistillTerm(per_token=coef * ratio * reverse_kl, reverse_kl=reverse_kl, covered=covered)
