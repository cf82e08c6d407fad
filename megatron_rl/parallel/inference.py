"""Forward-only passes of a (TP/PP-sharded) megatron GPT model over plain token batches.

Used by the parity checks and evaluation. Results exist on the last PP stage and are
broadcast to every rank so callers need not care where they came from.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.parallel.schedule import run_schedule
from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs


def _forward_step(model, input_ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    return model(input_ids, positions, attention_mask=None)


def _broadcast_from_last_stage(value: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return value
    buf = value.contiguous() if value is not None else torch.empty(shape, dtype=torch.float32)
    src = parallel_state.get_pipeline_model_parallel_last_rank()
    dist.broadcast(buf, src=src, group=parallel_state.get_pipeline_model_parallel_group())
    return buf


def _reduce_on_last_stage(model, input_ids: torch.Tensor, reduce, shape: tuple[int, ...]) -> torch.Tensor:
    """Forward ``input_ids``, apply ``reduce(vocab-parallel logits, ids)`` on the last stage, and
    return the result on every rank."""
    out = run_schedule(
        model,
        [input_ids],
        forward_step=_forward_step,
        loss=lambda logits, ids: (logits.sum() * 0, reduce(logits, ids)),
        seq_length=lambda ids: ids.shape[1],
        forward_only=True,
    )
    return _broadcast_from_last_stage(out[0] if out else None, shape)


@torch.no_grad()
def forward_logits(model, input_ids: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary fp32 logits ``[b, s, vocab_size]`` (gathered over TP; for tests and tools)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    def full_logits(logits, _ids):
        return gather_from_tensor_model_parallel_region(logits)[..., :vocab_size].float()

    return _reduce_on_last_stage(model, input_ids, full_logits, (*input_ids.shape, vocab_size))


@torch.no_grad()
def forward_logprobs(model, input_ids: torch.Tensor, *, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t >= 1, ``[b, s - 1]`` fp32, from vocab-parallel logits."""

    def token_logprobs(logits, ids):
        return vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=vocab_size, temperature=temperature)

    b, s = input_ids.shape
    return _reduce_on_last_stage(model, input_ids, token_logprobs, (b, s - 1))


@torch.no_grad()
def forward_packed_logits(model, mb, *, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary fp32 logits ``[T, vocab_size]`` of a shared-prompt ``PackedMicroBatch``
    (the model built with shared-prompt attention), on every rank. Under context parallelism
    each CP rank forwards its slice (``attention.cp_split``) and the rows are all-gathered."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_rl.attention.context import packed_attention
    from megatron_rl.attention.context_parallel import gather_rows
    from megatron_rl.attention.cp_split import cp_slice_of

    cp = ps.get_context_parallel_world_size()
    sl = cp_slice_of(mb.layout, cp, ps.get_context_parallel_rank()) if cp > 1 else None
    rows = sl.local_index if sl is not None else torch.arange(mb.num_tokens)

    def step(m, item):
        device = next(m.parameters()).device
        ids, pos = (x.to(device)[rows.to(device)][None] for x in (item.token_ids, item.position_ids))
        with packed_attention(item.layout, sl):
            return m(ids, pos, attention_mask=None)

    def full(logits, _item):
        out = gather_from_tensor_model_parallel_region(logits)[0, :, :vocab_size].float()
        if sl is None:
            return out
        return gather_rows(out, sl.tokens, rank=sl.rank, group=ps.get_context_parallel_group(), sum_grads=False)

    out = run_schedule(
        model,
        [mb],
        forward_step=step,
        loss=lambda logits, item: (logits.sum() * 0, full(logits, item)),
        seq_length=lambda item: item.num_tokens,
        forward_only=True,
    )
    return _broadcast_from_last_stage(out[0] if out else None, (mb.num_tokens, vocab_size))
