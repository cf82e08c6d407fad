"""Shared-prompt packing through the whole megatron model equals the K-copies layout.

Subject: one packed micro-batch ``[prompt, r_1..r_K]`` per group, several groups, through a
model whose core attention is shared-prompt attention (each CPU-runnable backend).
Reference: every ``[prompt, r_i]`` as its own sequence through a model with megatron's own
``DotProductAttention``. Per-token log-probs and every parameter's gradient must agree, at
TP=1, TP=2 and PP=2 (gloo), with ragged responses, K = 1 and length-1 responses.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf

pytestmark = [pytest.mark.multiproc]

# (prompt length, response lengths) per group: ragged, K = 1, length-1 responses.
GROUPS = [(7, (3, 1, 5)), (4, (1,)), (9, (6, 2, 2, 4))]


def make_groups(vocab: int, seed: int = 3):
    from megatron_rl.attention.packing import TokenGroup

    g = torch.Generator().manual_seed(seed)
    return [
        TokenGroup(
            prompt_ids=torch.randint(0, vocab, (lp,), generator=g),
            response_ids=tuple(torch.randint(0, vocab, (n,), generator=g) for n in lens),
        )
        for lp, lens in GROUPS
    ]


def _run(model, micro_batches, vocab_size, *, forward_only: bool = False):
    """Forward+backward every micro-batch; return the response-token log-probs in order."""
    from megatron_rl.attention.context import packed_attention
    from megatron_rl.parallel.schedule import run_schedule
    from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs

    def forward_step(m, mb):
        ids, pos, layout = mb["ids"], mb["pos"], mb["layout"]
        with packed_attention(layout):
            return m(ids[None], pos[None], attention_mask=None)

    def loss(logits, mb):
        lp = vocab_parallel_logprobs(logits[0, mb["logit_index"]], mb["targets"], vocab_size=vocab_size)
        return (lp * mb["weights"]).sum(), lp.detach()

    payloads = run_schedule(
        model,
        micro_batches,
        forward_step=forward_step,
        loss=loss,
        seq_length=lambda mb: mb["ids"].numel(),
        forward_only=forward_only,
    )
    return torch.cat(payloads) if payloads else torch.empty(0)  # log-probs live on the last stage


def _packed_batches(groups, weights):
    from megatron_rl.attention.packing import pack_groups

    (mb,) = pack_groups(groups, token_budget=10_000)
    return [
        {
            "ids": mb.token_ids,
            "pos": mb.position_ids,
            "layout": mb.layout,
            "logit_index": mb.logit_index,
            "targets": mb.target_ids,
            "weights": weights,
        }
    ]


def _copy_batches(groups, weights):
    """K copies: each response as its own causal sequence [prompt, r_i] (built independently)."""
    out, n = [], 0
    for g in groups:
        lp = g.prompt_ids.numel()
        for r in g.response_ids:
            seq = torch.cat([g.prompt_ids, r])
            idx = torch.arange(lp - 1, lp - 1 + r.numel())
            out.append(
                {
                    "ids": seq,
                    "pos": torch.arange(seq.numel()),
                    "layout": None,
                    "logit_index": idx,
                    "targets": r,
                    "weights": weights[n : n + r.numel()],
                }
            )
            n += r.numel()
    return out


def _worker(tp, pp, path, backend, forward_only=False, recompute=None):
    import os

    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import (fresh process)
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel

    initialize_parallel(tp=tp, pp=pp)
    subject, spec = load_model_from_hf(path, attention_backend=backend, megatron_overrides=recompute)
    reference, _ = load_model_from_hf(path, attention_backend=None)
    groups = make_groups(spec.vocab_size)
    n_tokens = sum(sum(lens) for _, lens in GROUPS)
    weights = torch.randn(n_tokens, generator=torch.Generator().manual_seed(11))
    lp_packed = _run(subject, _packed_batches(groups, weights), spec.vocab_size, forward_only=forward_only)
    lp_copies = _run(reference, _copy_batches(groups, weights), spec.vocab_size, forward_only=forward_only)
    grads = {}
    if forward_only:
        return lp_packed, lp_copies, grads
    for (name, p), (_, q) in zip(subject.named_parameters(), reference.named_parameters(), strict=True):
        grads[name] = (p.grad.clone(), q.grad.clone())
    return lp_packed, lp_copies, grads


def _check(results, n_tokens, check_grads=True):
    assert any(r[0].numel() for r in results), "no rank returned log-probs"
    for rank, (lp_packed, lp_copies, grads) in enumerate(results):
        if lp_packed.numel():
            assert lp_packed.shape == (n_tokens,)
            assert (lp_packed - lp_copies).abs().max() <= 1e-5, f"rank {rank} log-probs"
        assert grads or not check_grads, "no parameters"
        for name, (g, ref) in grads.items():
            rel = (g - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
            assert rel <= 1e-4, f"rank {rank} {name}: relative grad error {rel:.2e}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_hf(tmp_path_factory.mktemp("hf") / "qwen3", "qwen3", tied=False))


@pytest.mark.parametrize("backend", ["reference", "split"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_packed_equals_k_copies(checkpoint, backend, tp, pp):
    results = run_distributed(_worker, tp * pp, tp, pp, checkpoint, backend)
    _check(results, sum(sum(lens) for _, lens in GROUPS))


@pytest.mark.parametrize("tp", [1, 2])
def test_flex_forward_equals_k_copies(checkpoint, tp):
    """FlexAttention on CPU is forward-only in torch 2.13: log-probs only."""
    results = run_distributed(_worker, tp, tp, 1, checkpoint, "flex", True)
    _check(results, sum(sum(lens) for _, lens in GROUPS), check_grads=False)


def test_triton_interpreted_equals_k_copies(checkpoint):
    """The Triton kernel (forward + backward) under the CPU interpreter, through the whole model."""
    pytest.importorskip("triton")
    results = run_distributed(_worker, 1, 1, 1, checkpoint, "triton", fresh=True)  # TRITON_INTERPRET
    _check(results, sum(sum(lens) for _, lens in GROUPS))


# megatron's recompute re-runs a layer (full) or its core attention (selective) inside backward,
# after packed_attention() has exited: the recomputed layer must still see the packed layout.
RECOMPUTE = {
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
}


@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
def test_packed_with_recompute_equals_k_copies(checkpoint, recompute):
    results = run_distributed(_worker, 1, 1, 1, checkpoint, "split", False, RECOMPUTE[recompute])
    _check(results, sum(sum(lens) for _, lens in GROUPS))
