"""NPU backend without an NPU: the exact ``npu_fusion_attention`` call is checked field by
field, and an emulation of the operator's documented semantics (TND, cumulative sequence
ends without a leading 0, ``sparse_mode=3`` bottom-right causal, ``atten_mask`` True =
masked) run on that call reproduces the K-copies oracle, outputs and gradients."""

import math

import pytest
import torch
from megatron_rl_kernels.npu_args import build_npu_fusion_args, npu_fusion_call

from megatron_rl.attention import AttentionLayout, shared_prompt_attention
from megatron_rl.attention.npu import npu_attention, torch_npu_available
from tests.attention_cases import CASES, Case, k_copies_oracle, make_inputs, max_rel_err


def emulate_npu_fusion_attention(
    query, key, value, head_num, input_layout, *, atten_mask, scale, sparse_mode, actual_seq_qlen, actual_seq_kvlen
):
    """Dense per-sequence emulation of torch_npu.npu_fusion_attention (TND, sparse_mode 3)."""
    assert input_layout == "TND" and sparse_mode == 3 and query.shape[1] == head_num
    assert torch.equal(atten_mask.cpu(), torch.ones(2048, 2048).triu(1).bool())
    rep = head_num // key.shape[1]
    outs, q0, k0 = [], 0, 0
    for q1, k1 in zip(actual_seq_qlen, actual_seq_kvlen, strict=True):
        q, k, v = query[q0:q1], key[k0:k1].repeat_interleave(rep, 1), value[k0:k1].repeat_interleave(rep, 1)
        sq, skv = q1 - q0, k1 - k0
        masked = torch.arange(skv)[None, :] > torch.arange(sq)[:, None] + (skv - sq)  # bottom-right
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        p = torch.softmax(s.masked_fill(masked, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
        q0, k0 = q1, k1
    assert q0 == query.shape[0] and k0 == key.shape[0]
    return (torch.cat(outs), None, None, None, 0, 0, 0)


def test_exact_call_tensors() -> None:
    # group 0: prompt 3, responses 2, 1, 2 (packed rows 0-2 | 3-4 | 5 | 6-7); group 1: plain sequence of 2
    fa = build_npu_fusion_args([3, 2], [[2, 1, 2], []])
    assert fa.actual_seq_qlen == (5, 6, 8, 10)  # [p; r1], r2, r3, [p']
    assert fa.actual_seq_kvlen == (5, 9, 14, 16)  # [p; r1], [p; r2], [p; r3], [p']
    assert fa.kv_index.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 0, 1, 2, 6, 7, 8, 9]
    assert fa.sparse_mode == 3
    assert fa.atten_mask.dtype == torch.bool and fa.atten_mask.shape == (2048, 2048)
    assert fa.atten_mask[0, 1] and not fa.atten_mask[1, 0] and not fa.atten_mask[5, 5]
    q, k, v = torch.randn(10, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    call = npu_fusion_call(q, k, v, fa, 0.25)
    assert call.args[0] is q and call.args[3:] == (4, "TND")
    assert torch.equal(call.args[1], k[fa.kv_index]) and torch.equal(call.args[2], v[fa.kv_index])
    assert call.kwargs["scale"] == 0.25 and call.kwargs["sparse_mode"] == 3
    assert call.kwargs["actual_seq_qlen"] == [5, 6, 8, 10] and call.kwargs["actual_seq_kvlen"] == [5, 9, 14, 16]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_emulated_call_matches_k_copies(case: Case) -> None:
    x = make_inputs(case)
    scale = 1.0 / math.sqrt(case.d)
    fa = build_npu_fusion_args(case.prompt_lens, case.response_lens)
    q, k, v = (t.clone().requires_grad_() for t in (x.q, x.k, x.v))
    call = npu_fusion_call(q, k, v, fa, scale)
    out = emulate_npu_fusion_attention(*call.args, **call.kwargs)[0]
    (out * x.w).sum().backward()
    ref = k_copies_oracle(case, x, scale)
    torch.testing.assert_close(out.detach(), ref.out, atol=1e-5, rtol=1e-5)
    for got, want in ((q.grad, ref.dq), (k.grad, ref.dk), (v.grad, ref.dv)):
        assert max_rel_err(got, want) <= 1e-4


@pytest.mark.skipif(torch_npu_available(), reason="torch_npu is installed")
def test_clear_errors_without_torch_npu() -> None:
    layout = AttentionLayout.from_lengths([3], [[2]])
    q = torch.randn(5, 2, 16)
    with pytest.raises(ValueError, match="torch_npu"):
        shared_prompt_attention(q, q, q, layout, backend="npu")
    with pytest.raises(RuntimeError, match="torch_npu"):
        npu_attention(q, q, q, layout, 0.25)
