"""Arguments of ``torch_npu.npu_fusion_attention`` for shared-prompt attention (pure PyTorch).

One call, TND layout, ``sparse_mode=3`` (bottom-right causal per sequence, with the
compressed 2048 x 2048 ``triu(ones, 1)`` mask, True = masked). Per group the query
sequences are, in packed order, ``[prompt; r_1]``, ``r_2``, ..., ``r_K``, so the query is
the packed ``q`` itself and the output needs no permutation. Their key/value sequences are
``[prompt; r_1]`` (a square: causal prompt plus r_1), then ``[prompt; r_i]`` for i >= 2:
bottom-right causal makes r_i's j-th token see the prompt and r_i[:j+1], which is the
shared-prompt mask exactly. Key/value are gathered with ``kv_index``: that copies the prompt
K/V K-1 times per group (memory ``(K-1) * Lp * Hkv * D`` per layer, freed after the call);
the gather's backward sums the prompt's gradients over the copies. ``actual_seq_qlen`` and
``actual_seq_kvlen`` are cumulative ends without a leading 0, as torch_npu wants them.

Nothing here imports torch_npu: the exact call is built as data (``NpuFusionCall``) so it
can be unit-tested on a CPU against an emulation of the operator's semantics.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

SPARSE_MODE_BOTTOM_RIGHT_CAUSAL = 3
COMPRESSED_MASK_SIZE = 2048


@dataclass(frozen=True, kw_only=True)
class NpuFusionArgs:
    """The per-micro-batch part of the call (independent of the layer's tensors)."""

    kv_index: torch.Tensor  # [Tkv] int64, packed rows gathered into key/value
    actual_seq_qlen: tuple[int, ...]  # cumulative query ends, no leading 0
    actual_seq_kvlen: tuple[int, ...]  # cumulative key/value ends, no leading 0
    atten_mask: torch.Tensor  # [2048, 2048] bool, True = masked (compressed causal mask)
    sparse_mode: int = SPARSE_MODE_BOTTOM_RIGHT_CAUSAL


@dataclass(frozen=True, kw_only=True)
class NpuFusionCall:
    """``torch_npu.npu_fusion_attention(*args, **kwargs)`` exactly as it will be issued."""

    args: tuple[Any, ...]  # (query [T, Hq, D], key [Tkv, Hkv, D], value [Tkv, Hkv, D], head_num, "TND")
    kwargs: dict[str, Any]


def build_npu_fusion_args(
    prompt_lens: Sequence[int], response_lens: Sequence[Sequence[int]], device: torch.device | str = "cpu"
) -> NpuFusionArgs:
    """Sequence boundaries and K/V gather for groups packed back to back (see module doc)."""
    q_lens: list[int] = []
    kv_lens: list[int] = []
    kv_rows: list[torch.Tensor] = []
    start = 0
    for lp, lrs in zip(prompt_lens, response_lens, strict=True):
        prompt = torch.arange(start, start + lp)
        first = lrs[0] if lrs else 0
        q_lens.append(lp + first)
        kv_lens.append(lp + first)
        kv_rows.append(torch.arange(start, start + lp + first))
        r_start = start + lp + first
        for lr in lrs[1:]:
            q_lens.append(lr)
            kv_lens.append(lp + lr)
            kv_rows += [prompt, torch.arange(r_start, r_start + lr)]
            r_start += lr
        start = r_start
    mask = torch.triu(torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool), diagonal=1)
    return NpuFusionArgs(
        kv_index=torch.cat(kv_rows).to(device),
        actual_seq_qlen=tuple(itertools.accumulate(q_lens)),
        actual_seq_kvlen=tuple(itertools.accumulate(kv_lens)),
        atten_mask=mask.to(device),
    )


def npu_fusion_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fa: NpuFusionArgs, softmax_scale: float
) -> NpuFusionCall:
    """The call for packed q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` (GQA: Hq a multiple of Hkv)."""
    return NpuFusionCall(
        args=(q, k[fa.kv_index], v[fa.kv_index], q.shape[1], "TND"),
        kwargs={
            "atten_mask": fa.atten_mask,
            "scale": softmax_scale,
            "sparse_mode": fa.sparse_mode,
            "actual_seq_qlen": list(fa.actual_seq_qlen),
            "actual_seq_kvlen": list(fa.actual_seq_kvlen),
        },
    )
