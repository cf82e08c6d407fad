"""Chunked log-probs: the head runs only on scored positions, a few at a time, and changes nothing.

Subject: ``TriModel`` with ``logprob_chunk_tokens`` = 3 (every micro-batch is scored in several
chunks, the policy's checkpointed) and entropy on. Reference: the same checkpoint through
megatron's own forward (full ``[T, V]`` logits, ``tests.test_trimodel._separate``) and a plain
``log_softmax`` entropy of those logits. Log-probs, entropy and policy gradients must agree, at
TP = 1 and TP = 2 (tied and untied heads), and no op may produce a tensor with more than
``chunk × V/tp`` logits while scoring.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.algorithms.losses import LossSettings
from megatron_rl.trimodel.plan import plan_trimodel
from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf
from tests.test_trimodel import GROUPS, _micro_batches, _separate

pytestmark = [pytest.mark.multiproc]

CHUNK = 3


class LargestOutput(TorchDispatchMode):
    """Records the largest float tensor any op produces (numel) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


def _worker(tp, path):
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.parallel.vocab_parallel import vocab_parallel_entropy
    from megatron_rl.trimodel import LogprobSettings, TriModel
    from megatron_rl.trimodel.logprobs import head_logprobs

    initialize_parallel(tp=tp, pp=1)
    policy, spec = load_model_from_hf(path, attention_backend="split")
    vocab = spec.vocab_size
    mbs, weights = _micro_batches(vocab)
    tri = TriModel(
        policy=policy,
        old=None,
        ref=None,
        plan=plan_trimodel(LossSettings(), optimizer_steps_per_batch=1),
        logprobs=LogprobSettings(vocab_size=vocab, with_entropy=True, logprob_chunk_tokens=CHUNK),
    )
    out = tri.run(mbs, loss=lambda lp, i: ((lp.policy * weights[i]).sum(), (lp.policy.detach(), lp.entropy.detach())))
    chunked = torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])

    reference, _ = load_model_from_hf(path, attention_backend="split")
    want = _separate(reference, mbs, weights, vocab, forward_only=False)
    entropies = []
    with torch.no_grad():
        from megatron_rl.attention.context import packed_attention

        for mb in mbs:
            with packed_attention(mb.layout):
                logits = reference(mb.token_ids[None], mb.position_ids[None], attention_mask=None)[0, mb.logit_index]
            entropies.append(vocab_parallel_entropy(logits, vocab_size=vocab))
    grads = {
        n: (p.grad.clone(), q.grad.clone())
        for (n, p), (_, q) in zip(policy.named_parameters(), reference.named_parameters(), strict=True)
    }

    hidden = torch.randn(400, spec.hidden_size, requires_grad=True)  # 400 positions > hidden size
    targets = torch.randint(0, vocab, (hidden.shape[0],))
    with LargestOutput() as seen:
        lp, _ = head_logprobs(
            policy, hidden, targets, vocab_size=vocab, temperature=1.0, with_entropy=True, chunk_tokens=CHUNK
        )
        lp.sum().backward()
    head = (
        policy.shared_embedding_or_output_weight()
        if policy.share_embeddings_and_output_weights
        else policy.output_layer.weight
    )  # [V/tp, h]: it, its gradient and the hidden states may be larger
    return dict(
        chunked=chunked,
        want=want,
        entropy=torch.cat(entropies),
        grads=grads,
        largest=seen.largest,
        bound=max(CHUNK * head.shape[0], head.numel(), hidden.numel()),
        full=hidden.shape[0] * head.shape[0],
    )


@pytest.mark.parametrize("tp,tied", [(1, True), (2, False)])
def test_chunked_logprobs_equal_full_logits(tmp_path, tp, tied):
    path = str(make_tiny_hf(tmp_path / "m", "qwen3", tied=tied, layers=2))
    n_tokens = sum(sum(lens) for _, lens in GROUPS)
    for rank, r in enumerate(run_distributed(_worker, tp, tp, path)):
        lp, ent = r["chunked"]
        assert lp.shape == (n_tokens,) and ent.shape == (n_tokens,)
        assert (lp - r["want"]).abs().max() <= 1e-5, f"rank {rank}: log-probs"
        assert (ent - r["entropy"]).abs().max() <= 1e-5, f"rank {rank}: entropy"
        for name, (g, ref) in r["grads"].items():
            rel = (g - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
            assert rel <= 1e-4, f"rank {rank} {name}: relative grad error {rel:.2e}"
        # Peak: no [N, V/tp] logits tensor (N = 400 positions) exists at once, only chunks of 3.
        assert r["largest"] <= r["bound"] < r["full"], (r["largest"], r["bound"], r["full"])
