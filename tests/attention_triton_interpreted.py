"""Triton shared-prompt kernel under the CPU interpreter. Run only by
``test_attention_triton.py`` in a subprocess with ``TRITON_INTERPRET=1`` (the variable must
be set before triton is imported, and must not leak into the rest of the suite)."""

import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

from megatron_rl_kernels.triton_shared_prompt import build_block_plan  # noqa: E402

from megatron_rl.attention import AttentionLayout, shared_prompt_attention  # noqa: E402
from megatron_rl.attention.triton_backend import triton_attention  # noqa: E402
from tests.attention_cases import Case, k_copies_oracle, make_inputs, max_rel_err  # noqa: E402

BLOCK = 16
TINY = (
    Case("ragged_groups_gqa", (16, 5), ((3, 9, 5), (4, 8)), hq=4, hkv=2, d=32),
    Case("k1_len1", (16, 3, 7), ((1,), (1, 1, 1), (9,)), hq=2, hkv=2, d=32),
)


def _run(case: Case, dtype: torch.dtype):
    x = make_inputs(case, seed=1, dtype=dtype)
    layout = AttentionLayout.from_lengths(case.prompt_lens, case.response_lens)
    q, k, v = (t.clone().requires_grad_() for t in (x.q, x.k, x.v))
    out = triton_attention(q, k, v, layout, 1.0 / math.sqrt(case.d), block=BLOCK)
    (out.float() * x.w.float()).sum().backward()
    ref_inputs = type(x)(*(t.float() for t in (x.q, x.k, x.v, x.w)))  # oracle in fp32 on the same values
    ref = k_copies_oracle(case, ref_inputs, 1.0 / math.sqrt(case.d))
    return out, (q.grad, k.grad, v.grad), ref


@pytest.mark.parametrize("case", TINY, ids=lambda c: c.name)
def test_triton_fp32_forward_backward(case: Case) -> None:
    out, (dq, dk, dv), ref = _run(case, torch.float32)
    torch.testing.assert_close(out, ref.out, atol=1e-5, rtol=1e-5)
    for name, got, want in (("dq", dq, ref.dq), ("dk", dk, ref.dk), ("dv", dv, ref.dv)):
        assert max_rel_err(got, want) <= 1e-4, name


def test_triton_bf16_upcast_path() -> None:
    out, grads, ref = _run(TINY[0], torch.bfloat16)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    assert max_rel_err(out.float(), ref.out) <= 1e-2
    for got, want in zip(grads, (ref.dq, ref.dk, ref.dv), strict=True):
        assert max_rel_err(got.float(), want) <= 2e-2


def _visible_blocks(case: Case, block: int) -> torch.Tensor:
    """[n_qb, n_kb] bool from a mask written out per group (independent of the layout code)."""
    t = case.total
    mask = torch.zeros(t, t, dtype=torch.bool)
    start = 0
    for lp, lrs in zip(case.prompt_lens, case.response_lens, strict=True):
        mask[start : start + lp, start : start + lp] = torch.ones(lp, lp).tril().bool()
        r = start + lp
        for lr in lrs:
            mask[r : r + lr, start : start + lp] = True
            mask[r : r + lr, r : r + lr] = torch.ones(lr, lr).tril().bool()
            r += lr
        start = r
    n = -(-t // block)
    padded = torch.zeros(n * block, n * block, dtype=torch.bool)
    padded[:t, :t] = mask
    return padded.view(n, block, n, block).any(3).any(1)


@pytest.mark.parametrize("case", TINY, ids=lambda c: c.name)
def test_block_plan_visits_exactly_the_unmasked_blocks(case: Case) -> None:
    layout = AttentionLayout.from_lengths(case.prompt_lens, case.response_lens)
    plan = build_block_plan(layout.group_start, layout.prefix_end, layout.seg_start, block_m=8, block_n=8, device="cpu")
    want = _visible_blocks(case, 8)
    got = torch.zeros_like(want)
    for qb, (row, count) in enumerate(zip(plan.kv_blocks, plan.kv_count, strict=True)):
        got[qb, row[:count].long()] = True
    assert torch.equal(got, want)
    assert not want.all(), "the case should have fully masked blocks to skip"
    got_t = torch.zeros_like(want.T)
    for kb, (row, count) in enumerate(zip(plan.q_blocks, plan.q_count, strict=True)):
        got_t[kb, row[:count].long()] = True
    assert torch.equal(got_t, want.T)


def test_dispatch_runs_triton_under_interpreter() -> None:
    case = TINY[1]
    x = make_inputs(case)
    layout = AttentionLayout.from_lengths(case.prompt_lens, case.response_lens)
    out = shared_prompt_attention(x.q, x.k, x.v, layout, backend="triton")  # default block 64
    torch.testing.assert_close(out, k_copies_oracle(case, x, 1.0 / math.sqrt(case.d)).out, atol=1e-5, rtol=1e-5)
