"""Next-token sampling for the ``hf`` engine: temperature, top-p, per-request randomness.

Conventions (the ``vllm`` engine follows the same ones, see ``backends.vllm``):

- ``temperature == 0`` means greedy (argmax, first index on ties); its log-prob is reported at
  temperature 1, i.e. ``log_softmax(logits)[token]``.
- The reported behaviour log-prob of a sampled token is its log-prob under the distribution
  it was sampled from: ``log_softmax(logits / T)`` truncated to the top-p set and
  renormalised, i.e. ``log_softmax(logits / T)[token] − log Σ_{kept} p``. That is what vLLM's
  ``processed_logprobs`` reports (and what TRL's importance-sampling correction expects), so
  both engines report the same quantity for any temperature and top-p. With ``top_p == 1``
  nothing is truncated (and nothing subtracted): it is exactly what the trainer computes
  (``vocab_parallel_logprobs(..., temperature=T)``), so the ``mismatch/…`` metrics measure only
  engine numerics and weight sync. With ``top_p < 1`` the trainer's full-distribution
  log-prob is lower by the truncated mass, and the mismatch metrics and the importance ratio
  π_trainer / π_behav (< 1) include that deliberate gap (see ``algorithms/correction.py``).
- Randomness comes from one uniform draw per sampled token, taken from the request's own
  generator, and inverse-CDF sampling over the (truncated, renormalised) distribution: a
  request's sample depends only on its seed and its own logits, never on the batch it ran in.
"""

from __future__ import annotations

import torch


def top_p_mask(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep-mask over ``sorted_probs [B, V]`` (descending) for nucleus sampling with ``top_p [B]``.

    A token is kept while the mass of the tokens ranked above it is below ``top_p``; the most
    likely token is always kept.
    """
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep = mass_before < top_p[:, None]
    keep[:, 0] = True
    return keep


def sample_next(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args: ``logits [B, V]`` (any float dtype; computed in fp32), ``temperature [B]`` (0 = greedy),
    ``top_p [B]`` in (0, 1], ``uniforms [B]`` in [0, 1) (ignored for greedy rows).
    Returns ``tokens [B]`` (int64) and their behaviour log-probs ``[B]`` (fp32): under the
    top-p-truncated, renormalised distribution for sampled rows (see the module docstring).
    """
    logits = logits.float()
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
    sorted_lp, order = logprobs.sort(dim=-1, descending=True, stable=True)
    sorted_probs = sorted_lp.exp()
    keep = top_p_mask(sorted_probs, top_p.float())
    cdf = (sorted_probs * keep).cumsum(-1)
    target = uniforms.float().clamp(0, 1)[:, None] * cdf[:, -1:]
    # A rank past the kept set can only come from rounding at the top of the CDF.
    rank = torch.minimum((cdf <= target).sum(-1), keep.sum(-1) - 1)
    sampled = order.gather(-1, rank[:, None]).squeeze(-1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    full = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    kept_log_mass = torch.logsumexp(sorted_lp.masked_fill(~keep, float("-inf")), dim=-1)
    truncated = ~greedy & (top_p < 1)  # top_p == 1: no truncation, report the plain log-prob
    return tokens, torch.where(truncated, full - kept_log_mass, full)
