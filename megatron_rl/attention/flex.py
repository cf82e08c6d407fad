"""``flex`` backend: FlexAttention over the packed micro-batch with a block mask.

The mask function reads the layout's three ``[T]`` arrays (see ``layout``), so fully masked
blocks (other groups, other responses) are skipped. CUDA: forward and backward. CPU (torch
2.13): forward only, under ``torch.compile``; an input that requires grad raises, and after
such a failure later calls in the process were seen to run ~12x slower, so the dispatcher
refuses grad on CPU before calling.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from megatron_rl.attention.layout import AttentionLayout


@cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _block_mask(layout: AttentionLayout, device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    gs, pe, ss = (x.to(device) for x in (layout.group_start, layout.prefix_end, layout.seg_start))

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        prefix = (kv_idx >= gs[q_idx]) & (kv_idx < pe[q_idx])
        return prefix | ((kv_idx >= ss[q_idx]) & (kv_idx <= q_idx))

    t = layout.total_tokens
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=t, KV_LEN=t, device=device)


def flex_attention_packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, softmax_scale: float
) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
    block_mask = layout.cached_plan(("flex", q.device), lambda: _block_mask(layout, q.device))
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D]
    out = _compiled_flex()(qh, kh, vh, block_mask=block_mask, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)
