"""The trainer's accumulated gradient does not depend on how a batch is split or ordered.

Same groups, same initial weights: one micro-batch vs a small token budget (several
micro-batches), groups fed one at a time in shuffled order (as periodic asynchrony delivers
them), and 2 data-parallel ranks each taking half: the weights after the optimizer step must
agree. The reference for the gradient is an independent computation: every response as its
own sequence through a stock-attention megatron model, the normalised batch loss written
out in the test, one backward.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf

pytestmark = [pytest.mark.multiproc]

GROUP_SHAPES = [(6, (3, 1, 4)), (5, (2, 2)), (8, (5, 1, 3, 2)), (4, (1, 6))]


def make_groups(vocab: int, masked: bool = False):
    """Scored groups as the producer makes them (random tokens, advantages, behaviour log-probs);
    ``masked``: multi-turn style loss masks (random 0/1 per response token, the first one 1)."""
    from megatron_rl.pipeline.records import Sample, ScoredGroup

    g = torch.Generator().manual_seed(5)
    out = []
    for i, (lp, lens) in enumerate(GROUP_SHAPES):
        prompt = tuple(torch.randint(0, vocab, (lp,), generator=g).tolist())
        samples = tuple(
            Sample(
                prompt_id=f"p{i}",
                request_id=f"0/p{i}/{k}",
                index=k,
                prompt_ids=prompt,
                response_ids=tuple(torch.randint(0, vocab, (n,), generator=g).tolist()),
                behav_logprobs=tuple((-torch.rand(n, generator=g)).tolist()),
                weight_version=0,
                finish_reason="stop",
                reward=0.0,
                loss_mask=(1, *torch.randint(0, 2, (n - 1,), generator=g).tolist()) if masked else None,
            )
            for k, n in enumerate(lens)
        )
        out.append(
            ScoredGroup(
                step=0,
                prompt_index=i,
                prompt_id=f"p{i}",
                samples=samples,
                rewards=torch.zeros(len(lens)),
                advantages=torch.randn(len(lens), generator=g),
                kept=True,
            )
        )
    return out


def _settings(path, kind):
    from megatron_rl.algorithms import LossSettings
    from megatron_rl.config.schema import AttentionConfig, ModelConfig, TrainerConfig
    from megatron_rl.trainer.build import TrainerSettings

    # SGD-like Adam (large eps): the update is a smooth function of the gradient, so the
    # comparison tests the gradient, not Adam's sign() of near-zero entries.
    return TrainerSettings(
        hf_path=path,
        model=ModelConfig(hf_path=path, dtype="float32"),
        attention=AttentionConfig(backend="split"),
        loss=LossSettings(kind=kind, clip_high=0.28),
        trainer=TrainerConfig(steps=1, lr=1e-2, adam_eps=1e-2, grad_clip=100.0),
    )


def _trained_weights(policy, spec):
    from megatron_rl.models import export_hf_tensors

    return {n: t.clone() for n, t in export_hf_tensors(policy, spec)}


def _trainer_worker(path, kind, budget, shuffle, masked=False):
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.build import build_policy_trainer

    _, layout = initialize_parallel(tp=1, pp=1)
    settings = _settings(path, kind)
    from megatron_rl.pipeline.records import chunk_by_tokens, make_micro_batch

    trainer, policy, spec = build_policy_trainer(settings)
    groups = make_groups(spec.vocab_size, masked)[layout.dp_rank :: layout.dp]
    if shuffle:
        random.Random(0).shuffle(groups)
    trainer.begin_batch()
    for chunk in chunk_by_tokens(groups, budget):
        trainer.train_micro_batch(make_micro_batch(chunk, policy_version=0))
    result = trainer.finish_mini_batch()
    return _trained_weights(policy, spec), result.loss


def _reference_worker(path, kind, masked=False):
    """Independent: K copies through stock megatron attention, batch loss written out here; with
    ``masked`` only the tokens whose loss mask is 1 enter the sums, means and token count."""
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs
    from megatron_rl.trainer.optim import wrap_for_training

    initialize_parallel(tp=1, pp=1)
    settings = _settings(path, kind)
    model, spec = load_model_from_hf(path, attention_backend=None)
    ddp, optimizer = wrap_for_training(model, settings.trainer)
    ddp.zero_grad_buffer()
    terms, tokens, seqs = [], 0, 0
    for group in make_groups(spec.vocab_size, masked):
        prompt = torch.tensor(group.samples[0].prompt_ids)
        for sample, adv in zip(group.samples, group.advantages, strict=True):
            resp = torch.tensor(sample.response_ids)
            seq = torch.cat([prompt, resp])[None]
            logits = ddp(seq, torch.arange(seq.shape[1])[None], attention_mask=None)
            lp = vocab_parallel_logprobs(logits[0, prompt.numel() - 1 : -1], resp, vocab_size=spec.vocab_size)
            ratio = torch.exp(lp - lp.detach())  # on-policy: ratio 1, gradient of ratio = grad logp
            per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
            if masked:  # observation tokens: out of every term
                per_token = per_token[torch.tensor(sample.loss_mask, dtype=torch.bool)]
            terms.append(per_token.sum() if kind == "dapo" else per_token.mean())
            tokens, seqs = tokens + per_token.numel(), seqs + 1
    loss = torch.stack(terms).sum() / (tokens if kind == "dapo" else seqs)
    loss.backward()
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp])
    optimizer.step()
    return _trained_weights(model, spec), float(loss)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_hf(tmp_path_factory.mktemp("hf") / "llama", "llama", tied=True, layers=2))


def _assert_same(weights, ref):
    for key, value in ref.items():
        rel = (weights[key] - value).abs().max() / value.abs().max()
        assert rel <= 1e-5, f"{key}: relative difference {rel:.2e}"


@pytest.mark.parametrize(("kind", "masked"), [("grpo", False), ("dapo", False), ("grpo", True)])
def test_split_and_order_do_not_change_the_update(checkpoint, kind, masked):
    """``masked``: multi-turn loss masks; observation tokens carry no gradient (the reference
    leaves them out of its loss), whatever the split, order or DP layout."""
    ((ref, ref_loss),) = run_distributed(_reference_worker, 1, checkpoint, kind, masked)
    runs = (
        {
            "one micro-batch": run_distributed(_trainer_worker, 1, checkpoint, kind, 10_000, False, masked),
            "budget 20: several micro-batches": run_distributed(
                _trainer_worker, 1, checkpoint, kind, 20, False, masked
            ),
            "shuffled arrival, one group at a time": run_distributed(
                _trainer_worker, 1, checkpoint, kind, 20, True, masked
            ),
            "2 DP ranks": run_distributed(_trainer_worker, 2, checkpoint, kind, 24, True, masked),
        }
        if not masked
        else {  # the mask through a split, shuffled batch and over DP (the costly part: spawns)
            "shuffled arrival, one group at a time": run_distributed(
                _trainer_worker, 1, checkpoint, kind, 20, True, True
            ),
            "2 DP ranks": run_distributed(_trainer_worker, 2, checkpoint, kind, 24, True, True),
        }
    )
    for name, results in runs.items():
        for weights, loss in results:
            _assert_same(weights, ref)
            if name != "2 DP ranks":
                assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), name
