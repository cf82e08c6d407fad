"""Shared-prompt attention under context parallelism: Llama-3-style all-gather of K and V.

Each CP rank holds a per-segment zigzag slice of the packed micro-batch (``cp_split``). Per layer:

- forward: K and V of the rank's ``T_r`` tokens are all-gathered over the CP group into the whole
  packed ``[T, Hkv, D]`` (padded to the largest slice for the collective, then put in packed
  order); the rank's queries attend to them under the shared-prompt mask restricted to its rows
  (``cp_split.QueryRun``). A group's prompt is one segment of the packed sequence, so its K / V
  are gathered once per layer whatever the number of responses and ranks.
- backward: each rank's dK / dV over all T keys (from its own queries) are reduce-scattered
  (summed over the CP ranks, each keeps its own tokens' rows).

Memory per layer and rank (activations, one stream): the gathered K and V, ``2·T·(Hkv/tp)·D``
elements, kept for backward (recompute frees them); the rank's own Q / output are ``T_r``-sized.
Communication per layer and rank: forward all-gather of ``2·T·(Hkv/tp)·D`` elements (receives
``(cp-1)/cp`` of it), backward a reduce-scatter of the same size; log-probs are gathered once per
micro-batch (``gather_rows``, ``N`` fp32 values). gloo has no reduce-scatter: there the backward
all-reduces the padded buffer and keeps its slice (twice the traffic, CPU tests only).

Backends: ``reference`` (dense mask rows), ``split`` (batched SDPA over the runs, the CPU
path), ``flex`` (block mask with Q_LEN = T_r), ``triton`` (the block-sparse kernel with the rank's
T_r rows as queries at their packed positions, ``q_pos``, against the T keys:
``triton_backend.triton_rows_attention``) and ``npu`` (``npu_fusion_attention`` TND over the runs,
bottom-right causal: the single-rank NPU path's call with the runs as its sequences). ``auto``
picks ``flex`` on CUDA when cp > 1 (the triton CP path is checked under the CPU interpreter only).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.attention.cp_split import CPSlice, Partition, QueryRun
from megatron_rl.attention.triton_backend import triton_rows_attention

# Runs share one SDPA call while their key count is >= this fraction of the call's longest.
BUCKET_RATIO = 0.5


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


@dataclass(frozen=True)
class _GatherSpec:
    part: Partition
    rank: int
    group: object
    sum_grads: bool


class _GatherRows(torch.autograd.Function):
    """All-gather of a partitioned ``[n_r, ...]`` tensor into ``[n, ...]`` in item order."""

    @staticmethod
    def forward(ctx, x, spec: _GatherSpec):
        part, rank, group, sum_grads = spec.part, spec.rank, spec.group, spec.sum_grads
        width = part.max_count
        slot = part.slot().to(x.device)
        buf = x.new_empty((part.size * width, *x.shape[1:]))
        dist.all_gather_into_tensor(buf, _pad_rows(x.contiguous(), width), group=group)
        ctx.save_for_backward(slot)
        ctx.part, ctx.rank, ctx.group, ctx.sum_grads, ctx.n_local = part, rank, group, sum_grads, x.shape[0]
        return buf[slot]

    @staticmethod
    def backward(ctx, grad):
        (slot,) = ctx.saved_tensors
        part, rank, width = ctx.part, ctx.rank, ctx.part.max_count
        full = grad.new_zeros((part.size * width, *grad.shape[1:]))
        full[slot] = grad
        if not ctx.sum_grads:  # every rank holds the same loss: its own rows' gradient is the gradient
            return full[rank * width : rank * width + ctx.n_local], None
        if dist.get_backend(ctx.group) == "gloo":  # no reduce-scatter on gloo
            dist.all_reduce(full, group=ctx.group)
            mine = full[rank * width : (rank + 1) * width]
        else:
            mine = grad.new_empty((width, *grad.shape[1:]))
            dist.reduce_scatter_tensor(mine, full.contiguous(), group=ctx.group)
        return mine[: ctx.n_local], None


def gather_rows(x: torch.Tensor, part: Partition, *, rank: int, group, sum_grads: bool) -> torch.Tensor:
    """Rank ``rank``'s rows ``x [n_r, ...]`` of ``part`` -> all ``[n, ...]`` rows, item order.

    Backward: ``sum_grads=True`` reduce-scatters the gradient (K / V: every rank's queries
    contribute to every key); ``False`` keeps the rank's own rows of the gradient (log-probs: each
    rank computes the same loss from the gathered rows)."""
    if x.shape[0] != part.index[rank].numel():
        raise ValueError(f"rank {rank} holds {part.index[rank].numel()} rows of the partition, got {x.shape[0]}")
    return _GatherRows.apply(x, _GatherSpec(part, rank, group, sum_grads))


def _run_mask(runs: list[QueryRun], lq: int, lk: int) -> torch.Tensor:
    """``[B, 1, lq, lk]`` bool: bottom-right causal over each run's own key list, padding masked."""
    q_len = torch.tensor([r.end - r.start for r in runs])[:, None, None]
    k_len = torch.tensor([r.num_keys for r in runs])[:, None, None]
    i, j = torch.arange(lq)[None, :, None], torch.arange(lk)[None, None, :]
    return ((j < k_len) & (j <= k_len - q_len + i))[:, None]


def _run_keys(run: QueryRun) -> torch.Tensor:
    return torch.cat([torch.arange(run.prefix_start, run.prefix_end), torch.arange(run.seg_start, run.end)])


def _bucket_plan(cp_slice: CPSlice, device: torch.device) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]:
    """SDPA calls over bucketed runs: (q_index [B, lq] local, kv_index [B, lk] packed, mask, rows)
    each, and the permutation putting the calls' real rows back in local order."""
    offsets = list(itertools.accumulate((r.end - r.start for r in cp_slice.runs), initial=0))
    order = sorted(range(len(cp_slice.runs)), key=lambda i: -cp_slice.runs[i].num_keys)
    buckets: list[list[int]] = []
    for i in order:
        if buckets and cp_slice.runs[i].num_keys >= BUCKET_RATIO * cp_slice.runs[buckets[-1][0]].num_keys:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    calls, positions = [], []
    for members in buckets:
        runs = [cp_slice.runs[i] for i in members]
        lq, lk = max(r.end - r.start for r in runs), max(r.num_keys for r in runs)
        q_idx = torch.stack(
            [offsets[i] + torch.arange(lq).clamp(max=r.end - r.start - 1) for i, r in zip(members, runs, strict=True)]
        )
        kv_idx = torch.stack([F.pad(_run_keys(r), (0, lk - r.num_keys), value=r.start) for r in runs])
        real = torch.arange(lq)[None, :] < torch.tensor([r.end - r.start for r in runs])[:, None]
        rows = torch.nonzero(real.flatten()).flatten()
        calls.append(tuple(t.to(device) for t in (q_idx, kv_idx, _run_mask(runs, lq, lk), rows)))
        positions.append(q_idx.flatten()[rows])
    inverse = torch.argsort(torch.cat(positions)) if positions else torch.zeros(0, dtype=torch.int64)
    return calls, inverse.to(device)


def split_rows_attention(q, k, v, cp_slice: CPSlice, layout, *, softmax_scale: float) -> torch.Tensor:
    """``split`` under CP: local q ``[T_r, Hq, D]``, whole k / v ``[T, Hkv, D]`` -> ``[T_r, Hq, D]``."""
    calls, inverse = layout.cached_plan(
        ("cp_split", cp_slice.cp, cp_slice.rank, q.device), lambda: _bucket_plan(cp_slice, q.device)
    )
    gqa, pieces = q.shape[1] != k.shape[1], []
    for q_idx, kv_idx, mask, rows in calls:
        qb, kb, vb = q[q_idx].transpose(1, 2), k[kv_idx].transpose(1, 2), v[kv_idx].transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=softmax_scale, enable_gqa=gqa)
        pieces.append(out.transpose(1, 2).flatten(0, 1)[rows])
    return torch.cat(pieces)[inverse]


def reference_rows_attention(q, k, v, cp_slice: CPSlice, layout, *, softmax_scale: float) -> torch.Tensor:
    """``reference`` under CP: the dense mask's rows of this rank (O(T_r·T), tests only)."""
    mask = layout.cached_plan(
        ("cp_reference", cp_slice.rank, q.device), lambda: layout.dense_mask(q.device)[cp_slice.local_index]
    )
    groups = q.shape[1] // k.shape[1]
    kh, vh = (x.repeat_interleave(groups, dim=1).transpose(0, 1) for x in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1), kh, vh, attn_mask=mask, scale=softmax_scale).transpose(
        0, 1
    )


def flex_rows_attention(q, k, v, cp_slice: CPSlice, layout, *, softmax_scale: float) -> torch.Tensor:
    """``flex`` under CP: FlexAttention with ``Q_LEN = T_r`` rows mapped to their packed positions."""
    from torch.nn.attention.flex_attention import create_block_mask

    from megatron_rl.attention.flex import _compiled_flex

    def build():
        rows = cp_slice.local_index.to(q.device)
        gs, pe, ss = (x.to(q.device) for x in (layout.group_start, layout.prefix_end, layout.seg_start))

        def mask_mod(b, h, q_idx, kv_idx):
            t = rows[q_idx]
            return ((kv_idx >= gs[t]) & (kv_idx < pe[t])) | ((kv_idx >= ss[t]) & (kv_idx <= t))

        n, total = rows.numel(), layout.total_tokens
        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=total, device=q.device)

    block = layout.cached_plan(("cp_flex", cp_slice.rank, q.device), build)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = _compiled_flex()(qh, kh, vh, block_mask=block, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)


def npu_rows_attention(q, k, v, cp_slice: CPSlice, layout, *, softmax_scale: float) -> torch.Tensor:
    """``npu`` under CP: one ``npu_fusion_attention`` call whose TND sequences are the runs."""
    import torch_npu
    from megatron_rl_kernels.npu_args import npu_fusion_call

    fa = layout.cached_plan(("cp_npu", cp_slice.rank, q.device), lambda: npu_run_args(cp_slice, q.device))
    call = npu_fusion_call(q, k, v, fa, softmax_scale)
    return torch_npu.npu_fusion_attention(*call.args, **call.kwargs)[0]


def npu_run_args(cp_slice: CPSlice, device):
    """``NpuFusionArgs`` of the runs: query sequences are the runs (local order), key sequences
    each run's ``[prefix; own up to its end]``, bottom-right causal (``sparse_mode=3``)."""
    from megatron_rl_kernels.npu_args import COMPRESSED_MASK_SIZE, NpuFusionArgs

    runs = cp_slice.runs
    mask = torch.triu(torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool), diagonal=1)
    return NpuFusionArgs(
        kv_index=torch.cat([_run_keys(r) for r in runs]).to(device),
        actual_seq_qlen=tuple(itertools.accumulate(r.end - r.start for r in runs)),
        actual_seq_kvlen=tuple(itertools.accumulate(r.num_keys for r in runs)),
        atten_mask=mask.to(device),
    )


_ROWS_IMPLS = {
    "reference": reference_rows_attention,
    "split": split_rows_attention,
    "flex": flex_rows_attention,
    "triton": triton_rows_attention,
    "npu": npu_rows_attention,
}


def cp_attention(q, k, v, layout, cp_slice: CPSlice, *, backend: str, group, softmax_scale=None) -> torch.Tensor:
    """This rank's rows of shared-prompt attention: local q ``[T_r, Hq, D]``, k / v ``[T_r, Hkv, D]``
    -> ``[T_r, Hq, D]``; K / V all-gathered over ``group`` (the CP group), see the module doc.
    ``backend`` is a concrete name (``backends.resolve_backend``)."""
    if backend not in _ROWS_IMPLS:
        raise ValueError(
            f"attention.backend={backend!r} has no context-parallel path (parallel.cp={cp_slice.cp}); "
            f"use one of {sorted(_ROWS_IMPLS)}"
        )
    if q.shape[0] != cp_slice.local_index.numel():
        raise ValueError(f"CP rank {cp_slice.rank} holds {cp_slice.local_index.numel()} tokens, q has {q.shape[0]}")
    k_all = gather_rows(k, cp_slice.tokens, rank=cp_slice.rank, group=group, sum_grads=True)
    v_all = gather_rows(v, cp_slice.tokens, rank=cp_slice.rank, group=group, sum_grads=True)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _ROWS_IMPLS[backend](q, k_all, v_all, cp_slice, layout, softmax_scale=scale)
