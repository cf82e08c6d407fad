"""The block plan of the Triton shared-prompt kernel (``triton_shared_prompt``), built on the host.

Query row i (packed position ``q_pos[i]``) sees the keys ``[group_start[i], prefix_end[i]) ∪
[seg_start[i], q_pos[i]]``. The plan lists, per ``block_m`` block of query rows, the ``block_n``
key blocks any of its rows can see (and the transpose, for dK / dV), so the kernels skip fully
masked blocks. Rows are the packed positions on one rank (``q_pos = arange(T)``) or a context
parallel rank's tokens against the whole packed sequence's keys. Needs only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class BlockPlan:
    """Visited blocks of the mask, and the per-token arrays the kernels mask with."""

    block_m: int
    block_n: int
    num_keys: int  # T_k
    q_pos: torch.Tensor  # [T_q] int32, packed position of each query row
    group_start: torch.Tensor  # [T_q] int32, per query row (as prefix_end, seg_start)
    prefix_end: torch.Tensor  # [T_q] int32
    seg_start: torch.Tensor  # [T_q] int32
    kv_blocks: torch.Tensor  # [n_qb, max_kv] int32, key blocks each query block visits (padded)
    kv_count: torch.Tensor  # [n_qb] int32
    q_blocks: torch.Tensor  # [n_kb, max_q] int32, query blocks that see each key block
    q_count: torch.Tensor  # [n_kb] int32


def _block_lists(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] bool -> (padded column lists [rows, max] int32, counts [rows] int32)."""
    count = visible.sum(1)
    width = max(int(count.max()), 1) if visible.numel() else 1
    # stable sort puts visible columns first, in increasing order
    order = torch.sort((~visible).to(torch.int8), dim=1, stable=True).indices[:, :width]
    return order.to(torch.int32).contiguous(), count.to(torch.int32)


def build_block_plan(
    group_start: torch.Tensor,
    prefix_end: torch.Tensor,
    seg_start: torch.Tensor,
    *,
    block_m: int,
    block_n: int,
    device: torch.device | str,
    q_pos: torch.Tensor | None = None,
    num_keys: int | None = None,
) -> BlockPlan:
    """Which ``block_n`` key blocks each ``block_m`` query block can see (and the transpose).

    ``group_start`` / ``prefix_end`` / ``seg_start`` are per query row, ``q_pos`` the rows' packed
    positions (default ``arange``: every position is a row) and ``num_keys`` the key count T_k
    (default: the row count)."""
    t = group_start.numel()
    rows = torch.arange(t) if q_pos is None else q_pos.to("cpu", torch.int64)
    t_k = t if num_keys is None else num_keys
    n_qb, n_kb = -(-t // block_m), -(-t_k // block_n)
    qb = torch.arange(t) // block_m
    # each row sees up to two key intervals; mark their block ranges with a difference array
    has_prefix = prefix_end > group_start
    lo = torch.cat([group_start[has_prefix], seg_start]) // block_n
    hi = torch.cat([(prefix_end[has_prefix] - 1), rows]) // block_n
    owner = torch.cat([qb[has_prefix], qb])
    diff = torch.zeros(n_qb, n_kb + 1, dtype=torch.int64)
    diff.index_put_((owner, lo), torch.ones_like(lo), accumulate=True)
    diff.index_put_((owner, hi + 1), -torch.ones_like(hi), accumulate=True)
    visible = diff.cumsum(1)[:, :n_kb] > 0  # [n_qb, n_kb]
    kv_blocks, kv_count = _block_lists(visible)
    q_blocks, q_count = _block_lists(visible.T.contiguous())

    def dev(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=torch.int32).contiguous()

    return BlockPlan(
        block_m=block_m,
        block_n=block_n,
        num_keys=t_k,
        q_pos=dev(rows),
        group_start=dev(group_start),
        prefix_end=dev(prefix_end),
        seg_start=dev(seg_start),
        kv_blocks=dev(kv_blocks),
        kv_count=dev(kv_count),
        q_blocks=dev(q_blocks),
        q_count=dev(q_count),
    )
