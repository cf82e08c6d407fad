"""Rotary embeddings indexed by explicit position ids.

megatron-core's ``GPTModel`` derives RoPE angles from the sequence length alone (positions
0..s-1, or restarting per THD segment). The shared-prompt layout needs arbitrary positions:
every response restarts at len(prompt). ``PositionIndexedRotary`` wraps the model's
``RotaryEmbedding`` and returns the angles of the position ids given to ``forward``;
with positions 0..s-1 it is identical to the stock behaviour.

Every layout built here (shared-prompt packing, K copies, plain sequences) gives a token a position
no larger than its index in the sequence, so the angle table for ``max_seq_len`` (the sequence
length megatron passes) covers every position: no device->host read of ``max(position_ids)`` per
forward (a host sync on an accelerator). Under context parallelism the model holds a slice of
the packed sequence (``attention.context.current_cp``): its tokens keep their original
positions, the table spans the whole packed sequence and megatron's own CP slicing of the
table (for contiguous zigzag sequences) is bypassed.
"""

from __future__ import annotations

import torch

from megatron_rl.attention.context import current_cp


class PositionIndexedRotary(torch.nn.Module):
    """Drop-in for ``GPTModel.rotary_pos_emb`` that gathers angles at ``self.position_ids``."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.position_ids: torch.Tensor | None = None

    def get_rotary_seq_len(self, *args, **kwargs):
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        pos = self.position_ids
        if pos is None:
            return self.inner(max_seq_len, offset=offset, packed_seq=packed_seq, cp_group=cp_group)
        if pos.dim() == 2:
            if pos.shape[0] > 1 and not bool((pos == pos[:1]).all()):
                raise ValueError("position ids must be equal across the batch (packed inputs use batch size 1)")
            pos = pos[0]
        cp = current_cp()
        length = max(max_seq_len, cp.tokens.n) if cp is not None else max_seq_len
        # [length, 1, 1, d]: every position is below it; packed_seq: no CP slicing of the table
        table = self.inner(length, packed_seq=True)
        return table[pos]
