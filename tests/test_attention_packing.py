"""Packing of groups into shared-prompt micro-batches: positions, segments, the log-prob
index map, the token budget, unpacking, and a toy one-layer model whose per-token log-probs
and gradients equal the K-copies layout run as separate causal sequences."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.attention import (
    TokenGroup,
    k_copies,
    pack_groups,
    shared_prompt_attention,
    unpack_logprobs,
    unpack_logprobs_padded,
)


def _group(prompt, *responses) -> TokenGroup:
    return TokenGroup(prompt_ids=torch.tensor(prompt), response_ids=tuple(torch.tensor(r) for r in responses))


def test_single_group_fields() -> None:
    (mb,) = pack_groups([_group([10, 11, 12], [20, 21], [30])], token_budget=100)
    assert mb.token_ids.tolist() == [10, 11, 12, 20, 21, 30]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 3]
    assert mb.segment_ids.tolist() == [0, 0, 0, 1, 1, 2]
    assert mb.cu_seqlens.tolist() == [0, 3, 5, 6]
    assert mb.logit_index.tolist() == [2, 3, 2]  # both first tokens read the prompt's last position
    assert mb.target_ids.tolist() == [20, 21, 30]
    assert mb.response_lens == (2, 1)


def test_several_groups_offsets() -> None:
    (mb,) = pack_groups([_group([1, 2], [3]), _group([4, 5, 6], [7, 8], [9])], token_budget=9)
    assert mb.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert mb.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 3]
    assert mb.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert mb.segment_ids.tolist() == [0, 0, 1, 0, 0, 0, 1, 1, 2]
    assert mb.cu_seqlens.tolist() == [0, 2, 3, 6, 8, 9]
    assert mb.logit_index.tolist() == [1, 5, 6, 5]
    assert mb.target_ids.tolist() == [3, 7, 8, 9]
    assert mb.layout.total_tokens == 9


def test_budget_is_greedy_and_order_preserving() -> None:
    groups = [_group([1] * 3, [2] * 2), _group([1] * 2, [2]), _group([1] * 4, [2] * 3), _group([1], [2])]
    mbs = pack_groups(groups, token_budget=8)
    assert [mb.num_tokens for mb in mbs] == [8, 7, 2]  # 5 + 3 fit exactly; 7 alone; 2
    assert [mb.layout.groups[0].prompt_len for mb in mbs] == [3, 4, 1]
    with pytest.raises(ValueError, match="token budget 6"):
        pack_groups(groups, token_budget=6)
    with pytest.raises(ValueError, match="prompt_ids"):
        pack_groups([_group([], [1])], token_budget=6)


def test_unpack() -> None:
    (mb,) = pack_groups([_group([1, 2], [3, 4, 5], [6]), _group([7], [8, 9])], token_budget=20)
    per_token = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    rows = unpack_logprobs(per_token, mb)
    assert [r.tolist() for r in rows] == [
        pytest.approx([0.1, 0.2, 0.3]),
        pytest.approx([0.4]),
        pytest.approx([0.5, 0.6]),
    ]
    padded, mask = unpack_logprobs_padded(per_token, mb, pad_value=-1.0)
    assert mask.tolist() == [[True, True, True], [True, False, False], [True, True, False]]
    assert padded[1].tolist() == pytest.approx([0.4, -1.0, -1.0])
    with pytest.raises(ValueError, match="response tokens"):
        unpack_logprobs(per_token[:5], mb)


class _ToyLM(torch.nn.Module):
    """Embedding + learned positions + one attention layer + LM head (vocab 13, dim 16, 2 heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(13, 16), torch.nn.Embedding(32, 16)
        self.qkv, self.head = torch.nn.Linear(16, 48), torch.nn.Linear(16, 13)

    def forward(self, tokens, positions, attend):
        h = self.tok(tokens) + self.pos(positions)
        q, k, v = self.qkv(h).view(-1, 3, 2, 8).unbind(1)
        return self.head(h + attend(q, k, v).reshape(-1, 16))


def _causal(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True).transpose(0, 1)


def test_toy_model_logprobs_and_grads_match_k_copies() -> None:
    torch.manual_seed(0)
    model = _ToyLM()
    g = torch.Generator().manual_seed(1)
    groups = [
        _group(
            torch.randint(13, (lp,), generator=g).tolist(),
            *[torch.randint(13, (lr,), generator=g).tolist() for lr in lrs],
        )
        for lp, lrs in ((5, (3, 1, 6)), (2, (4,)), (7, (2, 2)))
    ]
    (mb,) = pack_groups(groups, token_budget=64)
    logits = model(
        mb.token_ids, mb.position_ids, lambda q, k, v: shared_prompt_attention(q, k, v, mb.layout, backend="split")
    )
    packed = F.log_softmax(logits[mb.logit_index], -1).gather(1, mb.target_ids[:, None])[:, 0]
    packed_rows = unpack_logprobs(packed, mb)
    packed_grads = torch.autograd.grad(packed.sum(), list(model.parameters()))

    copies = []  # K-copies written out: every [prompt, r_i] a plain causal sequence, standard shift
    for group in groups:
        for resp in group.response_ids:
            seq = torch.cat([group.prompt_ids, resp])
            lp = seq.numel() - resp.numel()
            lg = model(seq, torch.arange(seq.numel()), _causal)
            copies.append(F.log_softmax(lg[lp - 1 : -1], -1).gather(1, resp[:, None])[:, 0])
    copy_grads = torch.autograd.grad(torch.cat(copies).sum(), list(model.parameters()))
    assert len(packed_rows) == len(copies) == 6
    for got, want in zip(packed_rows, copies, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(packed_grads, copy_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_k_copies_layout() -> None:
    groups = [_group([1, 2], [3], [4, 5]), _group([6], [7])]
    copies = k_copies(groups)
    assert [(c.prompt_ids.tolist(), [r.tolist() for r in c.response_ids]) for c in copies] == [
        ([1, 2], [[3]]),
        ([1, 2], [[4, 5]]),
        ([6], [[7]]),
    ]
    (mb,) = pack_groups(copies, token_budget=20)
    assert mb.token_ids.tolist() == [1, 2, 3, 1, 2, 4, 5, 6, 7]
    assert mb.response_lens == (1, 2, 1)
