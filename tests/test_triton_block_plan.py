"""The Triton kernel's block plan (``megatron_rl_kernels.triton_block_plan``, torch only) under
context parallelism: a CP rank's query rows, at their packed positions, against all T keys.

Reference: the shared-prompt mask written out group by group here (not the layout's code), its
rows restricted to the rank's tokens and reduced to blocks."""

from __future__ import annotations

import pytest
import torch
from megatron_rl_kernels.triton_block_plan import build_block_plan

from megatron_rl.attention import AttentionLayout
from megatron_rl.attention.cp_split import build_cp_slice

PROMPTS, RESPONSES = (5, 12, 3), ((2, 6), (7,), (1, 4, 4))


def _written_mask(prompt_lens, response_lens) -> torch.Tensor:
    t = sum(prompt_lens) + sum(sum(r) for r in response_lens)
    mask = torch.zeros(t, t, dtype=torch.bool)
    start = 0
    for lp, lrs in zip(prompt_lens, response_lens, strict=True):
        mask[start : start + lp, start : start + lp] = torch.ones(lp, lp).tril().bool()
        r = start + lp
        for lr in lrs:
            mask[r : r + lr, start : start + lp] = True
            mask[r : r + lr, r : r + lr] = torch.ones(lr, lr).tril().bool()
            r += lr
        start = r
    return mask


def _blocks(rows_mask: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    n_q, n_k = rows_mask.shape
    qb, kb = -(-n_q // bm), -(-n_k // bn)
    padded = torch.zeros(qb * bm, kb * bn, dtype=torch.bool)
    padded[:n_q, :n_k] = rows_mask
    return padded.view(qb, bm, kb, bn).any(3).any(1)


def _listed(lists: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    got = torch.zeros(counts.numel(), width, dtype=torch.bool)
    for i, (row, count) in enumerate(zip(lists, counts, strict=True)):
        got[i, row[:count].long()] = True
    return got


@pytest.mark.parametrize(("cp", "bm", "bn"), [(2, 4, 8), (3, 8, 4), (2, 8, 8)])
def test_cp_rank_plan_visits_exactly_its_rows_blocks(cp: int, bm: int, bn: int) -> None:
    layout = AttentionLayout.from_lengths(PROMPTS, RESPONSES)
    mask = _written_mask(PROMPTS, RESPONSES)
    for rank in range(cp):
        rows = build_cp_slice(layout, cp, rank).local_index
        gs, pe, ss = (x[rows] for x in (layout.group_start, layout.prefix_end, layout.seg_start))
        n = layout.total_tokens
        plan = build_block_plan(gs, pe, ss, block_m=bm, block_n=bn, device="cpu", q_pos=rows, num_keys=n)
        want = _blocks(mask[rows], bm, bn)
        assert plan.num_keys == n and torch.equal(plan.q_pos.long(), rows)
        assert torch.equal(_listed(plan.kv_blocks, plan.kv_count, want.shape[1]), want), rank
        assert torch.equal(_listed(plan.q_blocks, plan.q_count, want.shape[0]), want.T), rank
        assert not want.all(), "the rank should have masked blocks to skip"


def test_rows_at_their_own_index_give_another_plan() -> None:
    """q_pos matters: the same rows planned as if at 0..T_r-1 miss blocks the rank needs."""
    layout = AttentionLayout.from_lengths(PROMPTS, RESPONSES)
    rows = build_cp_slice(layout, 2, 1).local_index
    gs, pe, ss = (x[rows] for x in (layout.group_start, layout.prefix_end, layout.seg_start))
    n = layout.total_tokens
    plan = build_block_plan(gs, pe, ss, block_m=4, block_n=4, device="cpu", num_keys=n)
    want = _blocks(_written_mask(PROMPTS, RESPONSES)[rows], 4, 4)
    assert not torch.equal(_listed(plan.kv_blocks, plan.kv_count, want.shape[1]), want)
