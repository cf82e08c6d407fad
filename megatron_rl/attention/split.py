"""``split`` backend: shared-prompt attention as a few dense SDPA calls; exact under autograd.

Per group, one causal call over ``[prompt; r_longest]`` (the prompt's own attention and the
longest response in one square), then the other responses in buckets of similar length,
batched: each response's queries (padded to the bucket's longest) attend to
``[prompt K/V; own K/V]`` under an explicit bottom-right causal mask (SDPA's ``is_causal``
is top-left aligned when query and key lengths differ). The prompt K/V is gathered once per
response of a bucket; autograd's scatter-add of that gather sums the prompt's K/V gradients
over the responses. This is the CPU training path.

The gather indices, masks and the final permutation are a ``SplitPlan``, built once per
micro-batch and device and cached on the ``AttentionLayout``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_rl.attention.layout import AttentionLayout, GroupSpan

# Responses go in one bucket while their length is >= this fraction of the bucket's longest.
BUCKET_RATIO = 0.5


@dataclass(frozen=True, kw_only=True)
class SplitCall:
    """One batched SDPA call: B sequences of ``Lq`` queries against ``Lk`` keys."""

    q_index: torch.Tensor  # [B, Lq] packed positions; padded rows repeat a real one
    kv_index: torch.Tensor  # [B, Lk]
    mask: torch.Tensor | None  # [B, 1, Lq, Lk] bool, True = attend; None = square causal
    rows: torch.Tensor  # [n] indices into the flattened [B * Lq] of the real query rows


@dataclass(frozen=True, kw_only=True)
class SplitPlan:
    calls: tuple[SplitCall, ...]
    inverse: torch.Tensor  # [T]: out = cat(real rows of every call)[inverse]


def _square_call(span: GroupSpan, resp: int | None) -> tuple[SplitCall, torch.Tensor]:
    prompt = torch.arange(span.start, span.start + span.prompt_len)
    if resp is not None:
        r_start = span.response_starts[resp]
        prompt = torch.cat([prompt, torch.arange(r_start, r_start + span.response_lens[resp])])
    idx = prompt[None, :]
    return SplitCall(q_index=idx, kv_index=idx, mask=None, rows=torch.arange(idx.numel())), prompt


def _bucket_call(span: GroupSpan, members: list[int]) -> tuple[SplitCall, torch.Tensor]:
    lens = torch.tensor([span.response_lens[i] for i in members])
    starts = torch.tensor([span.response_starts[i] for i in members])
    lmax, lp = int(lens.max()), span.prompt_len
    r = torch.arange(lmax)
    own = starts[:, None] + torch.minimum(r[None, :], lens[:, None] - 1)  # [B, lmax]
    prompt = torch.arange(span.start, span.start + lp).expand(len(members), lp)
    col = r[None, None, :]
    own_ok = (col <= r[None, :, None]) & (col < lens[:, None, None])  # [B, lmax, lmax]
    mask = torch.cat([torch.ones(len(members), lmax, lp, dtype=torch.bool), own_ok], dim=2)
    real = r[None, :] < lens[:, None]
    rows = torch.nonzero(real.flatten()).flatten()
    call = SplitCall(q_index=own, kv_index=torch.cat([prompt, own], dim=1), mask=mask[:, None], rows=rows)
    return call, own.flatten()[rows]


def _buckets(span: GroupSpan, members: list[int]) -> list[list[int]]:
    order = sorted(members, key=lambda i: -span.response_lens[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and span.response_lens[i] >= BUCKET_RATIO * span.response_lens[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def build_split_plan(layout: AttentionLayout, device: torch.device) -> SplitPlan:
    """Gather indices and masks of every SDPA call of the micro-batch, on ``device``."""
    calls, positions = [], []
    for span in layout.groups:
        lens = span.response_lens
        longest = max(range(len(lens)), key=lambda i: lens[i]) if lens else None
        call, pos = _square_call(span, longest)
        calls.append(call)
        positions.append(pos)
        rest = [i for i in range(len(lens)) if i != longest]
        for members in _buckets(span, rest):
            call, pos = _bucket_call(span, members)
            calls.append(call)
            positions.append(pos)
    inverse = torch.argsort(torch.cat(positions))
    assert inverse.numel() == layout.total_tokens
    moved = tuple(
        SplitCall(
            q_index=c.q_index.to(device),
            kv_index=c.kv_index.to(device),
            mask=None if c.mask is None else c.mask.to(device),
            rows=c.rows.to(device),
        )
        for c in calls
    )
    return SplitPlan(calls=moved, inverse=inverse.to(device))


def split_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, softmax_scale: float
) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]`` (Hq a multiple of Hkv)."""
    plan = layout.cached_plan(("split", q.device), lambda: build_split_plan(layout, q.device))
    gqa = q.shape[1] != k.shape[1]
    pieces = []
    for c in plan.calls:
        qb = q[c.q_index].transpose(1, 2)  # [B, Hq, Lq, D]
        kb, vb = k[c.kv_index].transpose(1, 2), v[c.kv_index].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=c.mask, is_causal=c.mask is None, scale=softmax_scale, enable_gqa=gqa
        )
        pieces.append(out.transpose(1, 2).flatten(0, 1)[c.rows])  # [n, Hq, D]
    return torch.cat(pieces)[plan.inverse]
