"""Per-token log-probs (and entropy) of selected positions, from the last stage's hidden states.

The language-model head runs only on the N positions whose next token is trained (response
tokens), not on all T packed positions (prompt positions need no logits), and in chunks of at
most ``chunk_tokens`` positions so that at most one chunk's ``[chunk, V/tp]`` fp32 logits are
alive at a time. With gradients, a chunked head is checkpointed: backward recomputes that
chunk's logits instead of keeping them (one more head matmul per chunk, only when N > chunk).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import checkpoint

from megatron_rl.parallel.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs


@contextlib.contextmanager
def hidden_states_only(gpt_model: torch.nn.Module) -> Iterator[None]:
    """While open, megatron's ``GPTModel.forward`` on the last stage returns the final-norm
    hidden states ``[s, b, h]`` instead of logits (its ``_postprocess`` stops before the head)."""
    gpt_model.post_process = False
    try:
        yield
    finally:
        gpt_model.post_process = True


def head_is_chunked(n: int, chunk_tokens: int) -> bool:
    """Whether the head scores ``n`` positions in chunks of ``chunk_tokens`` (checkpointed under
    autograd) rather than in one pass (the rule ``plan`` sizes memory by)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return n > chunk_tokens


def head_logprobs(
    gpt_model: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``hidden [N, h]`` (final-norm states of the positions to score), ``targets [N]`` ->
    (log-probs [N] fp32, entropy [N] fp32 or None), through ``gpt_model``'s output layer."""
    weight = gpt_model.shared_embedding_or_output_weight() if gpt_model.share_embeddings_and_output_weights else None
    dtype = weight.dtype if weight is not None else gpt_model.output_layer.weight.dtype

    def score(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, _ = gpt_model.output_layer(h.to(dtype)[:, None], weight=weight)  # [n, 1, V/tp]
        logits = logits[:, 0]
        lp = vocab_parallel_logprobs(logits, t, vocab_size=vocab_size, temperature=temperature)
        if not with_entropy:
            return (lp,)
        return lp, vocab_parallel_entropy(logits, vocab_size=vocab_size, temperature=temperature)

    n = hidden.shape[0]
    if not head_is_chunked(n, chunk_tokens):
        parts = [score(hidden, targets)]
    else:
        recompute = torch.is_grad_enabled() and hidden.requires_grad
        parts = [
            checkpoint(score, hidden[i : i + chunk_tokens], targets[i : i + chunk_tokens], use_reentrant=False)
            if recompute
            else score(hidden[i : i + chunk_tokens], targets[i : i + chunk_tokens])
            for i in range(0, n, chunk_tokens)
        ]
    lp = torch.cat([p[0] for p in parts])
    ent = torch.cat([p[1] for p in parts]) if with_entropy else None
    return lp, ent
