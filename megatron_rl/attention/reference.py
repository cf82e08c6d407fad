"""``reference`` backend: the whole micro-batch as one SDPA call under a dense ``[T, T]`` mask.

O(T^2) memory and compute, nothing skipped: slow and obviously right. Tests only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rl.attention.layout import AttentionLayout


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, softmax_scale: float
) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
    mask = layout.cached_plan(("reference", q.device), lambda: layout.dense_mask(q.device))
    groups = q.shape[1] // k.shape[1]
    kh = k.repeat_interleave(groups, dim=1).transpose(0, 1)  # [Hq, T, D]
    vh = v.repeat_interleave(groups, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kh, vh, attn_mask=mask, scale=softmax_scale)
    return out.transpose(0, 1)
