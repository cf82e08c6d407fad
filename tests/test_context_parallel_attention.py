"""Shared-prompt attention under context parallelism against the independent K-copies oracle.

Subject: ``attention.context_parallel.cp_attention`` on CP ranks joined by gloo, each holding its
per-segment zigzag slice of q / k / v (``attention.cp_split``); K / V all-gathered, dK / dV
reduce-scattered. Reference: ``tests.attention_cases.k_copies_oracle`` (every response as its own
causal sequence, plain SDPA). Outputs and dq / dk / dv, assembled from the ranks, must match.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.attention import AttentionLayout
from megatron_rl.attention.cp_split import build_cp_slice, chunk_bounds
from tests.attention_cases import CASES, Case, k_copies_oracle, make_inputs, max_rel_err
from tests.distributed import run_distributed

CP_CASES = [c for c in CASES if c.name in ("groups", "gqa", "mqa_with_plain_sequence", "len1")]


def test_zigzag_slices_cover_every_token_once_and_balance() -> None:
    layout = AttentionLayout.from_lengths((5, 12, 3), ((2, 6), (7,), (1, 4, 4)))
    for cp in (1, 2, 3, 4):
        slices = [build_cp_slice(layout, cp, r) for r in range(cp)]
        owned = torch.cat([s.local_index for s in slices])
        assert sorted(owned.tolist()) == list(range(layout.total_tokens))
        counts = [s.local_index.numel() for s in slices]
        assert max(counts) - min(counts) <= 2 * 9  # at most 2 tokens per segment (9 segments)
        for s in slices:  # local order is packed order; every run lies in one segment
            assert torch.equal(s.local_index, torch.sort(s.local_index).values)
            for run in s.runs:
                assert int(layout.seg_start[run.start]) == int(layout.seg_start[run.end - 1]) == run.seg_start
    assert chunk_bounds(7, 4) == [0, 2, 4, 6, 7]


def _cp_worker(cases: list[Case], backend: str):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return [_cp_case(case, backend) for case in cases]


def _cp_case(case: Case, backend: str):
    import torch.distributed as dist

    from megatron_rl.attention.context_parallel import cp_attention

    rank, cp = dist.get_rank(), dist.get_world_size()
    x = make_inputs(case, seed=0)
    layout = AttentionLayout.from_lengths(case.prompt_lens, case.response_lens)
    sl = build_cp_slice(layout, cp, rank)
    idx = sl.local_index
    q, k, v = (t[idx].clone().requires_grad_() for t in (x.q, x.k, x.v))
    out = cp_attention(q, k, v, layout, sl, backend=backend, group=dist.group.WORLD)
    (out * x.w[idx]).sum().backward()
    return idx, out.detach(), q.grad, k.grad, v.grad


@pytest.mark.multiproc
@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("backend", ["split", "reference"])
def test_cp_attention_matches_k_copies(cp: int, backend: str) -> None:
    per_rank = run_distributed(_cp_worker, cp, CP_CASES, backend)
    for i, case in enumerate(CP_CASES):
        results = [r[i] for r in per_rank]
        x = make_inputs(case, seed=0)
        ref = k_copies_oracle(case, x, 1.0 / math.sqrt(case.d))
        out, dq, dk, dv = (torch.zeros_like(t) for t in (x.q, x.q, x.k, x.v))
        for idx, o, gq, gk, gv in results:
            out[idx], dq[idx], dk[idx], dv[idx] = o, gq, gk, gv
        torch.testing.assert_close(out, ref.out, atol=1e-5, rtol=1e-5, msg=case.name)
        for name, got, want in (("dq", dq, ref.dq), ("dk", dk, ref.dk), ("dv", dv, ref.dv)):
            assert max_rel_err(got, want) <= 1e-5, f"{case.name} {name}"


def test_npu_run_args_match_the_mask() -> None:
    """The NPU call under CP (bottom-right causal over each run's [prefix; own] keys), emulated
    densely here, selects exactly the shared-prompt mask's rows of the rank."""
    pytest.importorskip("megatron_rl_kernels.npu_args")
    from megatron_rl.attention.context_parallel import npu_run_args

    layout = AttentionLayout.from_lengths((5, 3), ((4, 2, 6), (3,)))
    dense = layout.dense_mask()
    for rank in range(2):
        sl = build_cp_slice(layout, 2, rank)
        fa = npu_run_args(sl, "cpu")
        got = torch.zeros(sl.local_index.numel(), layout.total_tokens, dtype=torch.bool)
        q0 = k0 = 0
        for q1, k1 in zip(fa.actual_seq_qlen, fa.actual_seq_kvlen, strict=True):
            lq, lk = q1 - q0, k1 - k0
            for i in range(lq):
                got[q0 + i, fa.kv_index[k0 : k0 + lk - lq + i + 1]] = True
            q0, k0 = q1, k1
        assert torch.equal(got, dense[sl.local_index])


@pytest.mark.slow
def test_flex_rows_forward_equals_the_k_copies_rows() -> None:
    """``flex`` under CP (CPU: forward only, compiled): each rank's rows against the whole K / V,
    without the collective, equal the K-copies oracle's rows."""
    from megatron_rl.attention.context_parallel import flex_rows_attention

    case = next(c for c in CASES if c.name == "groups")
    x = make_inputs(case, seed=0)
    layout = AttentionLayout.from_lengths(case.prompt_lens, case.response_lens)
    scale = 1.0 / math.sqrt(case.d)
    ref = k_copies_oracle(case, x, scale)
    with torch.no_grad():
        for rank in range(2):
            sl = build_cp_slice(layout, 2, rank)
            out = flex_rows_attention(x.q[sl.local_index], x.k, x.v, sl, layout, softmax_scale=scale)
            torch.testing.assert_close(out, ref.out[sl.local_index], atol=1e-5, rtol=1e-5)
