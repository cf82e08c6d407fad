"""Per-token log-probs and entropy from vocab-parallel logits, never gathering the vocabulary.

Logits arrive as each TP rank's slice ``[..., V_pad / tp]`` of megatron's padded vocabulary.
Padding columns (ids >= the real vocabulary size) are masked out so they carry no probability.
"""

from __future__ import annotations

import torch


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set logits of padded vocabulary ids (>= ``vocab_size``) on this TP rank to the dtype minimum."""
    from megatron.core import parallel_state

    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    if start + local <= vocab_size:
        return logits
    pad = torch.arange(start, start + local, device=logits.device) >= vocab_size
    return logits.masked_fill(pad, torch.finfo(logits.dtype).min)


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per token.

    logits: ``[..., V_pad/tp]`` this rank's vocabulary slice (any leading shape);
    targets: ``[...]`` global token ids. Returns ``[...]`` fp32, differentiable, equal on every TP rank.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = mask_vocab_padding(logits.float() / temperature, vocab_size)
    return -vocab_parallel_cross_entropy(scaled, targets)


def vocab_parallel_entropy(logits: torch.Tensor, *, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per token, from TP-sharded logits ``[..., V_pad/tp]``.

    Differentiable; reduces max, sum-exp and sum(p * logit) over the TP group.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group = parallel_state.get_tensor_model_parallel_group()
    scaled = mask_vocab_padding(logits.float() / temperature, vocab_size)
    local_max = scaled.detach().amax(dim=-1, keepdim=True)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(local_max, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = scaled - local_max
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    sum_exp_logit = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    # H = log Z - E[x] with x the shifted logits and Z = sum exp(x).
    return sum_exp.log() - sum_exp_logit / sum_exp
