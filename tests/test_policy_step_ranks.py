"""``PolicyTrainer.finish_mini_batch`` across ranks: what each rank counts and decides.

- DP = 2 with the distributed optimizer: a NaN gradient confined to rows only replica 1 touched
  lives, after the reduce-scatter, in replica 1's optimizer shard alone (the test checks that it
  does). The step must be skipped on both ranks and leave the weights exactly as they were
  loaded; a verdict taken from one rank's gradients would step the other with NaN, and the
  parameter all-gather would spread it.
- TP = 2: the batch denominator is the written-out token count (counted once per replica, not
  once per TP rank; the accumulated gradient is scaled by its inverse, so this pins the update's
  scale) and the loss is the written-out on-policy DAPO loss −Σ_i A_i·|r_i| / Σ_i |r_i|.
"""

from __future__ import annotations

import torch

from tests.distributed import run_distributed
from tests.test_policy_trainer import _settings, _trained_weights, make_groups
from tests.test_policy_trainer import checkpoint as checkpoint  # noqa: F401 -- the module fixture


def _train(trainer, groups, budget: int = 24) -> None:
    from megatron_rl.pipeline.records import chunk_by_tokens, make_micro_batch

    trainer.begin_batch()
    for chunk in chunk_by_tokens(groups, budget):
        trainer.train_micro_batch(make_micro_batch(chunk, policy_version=0))


def _poison_a_row_in_shard_1(trainer, policy, groups, others) -> int:
    """NaN into the embedding gradient of a token only this replica's groups hold; returns the
    distributed-optimizer shard (DP rank) that owns those elements after the reduce-scatter."""
    mine = {t for g in groups for s in g.samples for t in s.prompt_ids + s.response_ids}
    theirs = {t for g in others for s in g.samples for t in s.prompt_ids + s.response_ids}
    row = min(mine - theirs)
    param = policy.embedding.word_embeddings.weight
    param.main_grad[row] = float("nan")
    (buffer,) = trainer.ddp.buffers
    start, _, bucket_id = buffer.param_index_map[param]
    bucket = buffer.buckets[bucket_id]
    at = start + row * param.shape[1] - bucket.offset  # the row's first element, within the bucket
    return at // (bucket.grad_data.numel() // 2)


def _nan_in_one_shard_worker(path):
    from dataclasses import replace

    from megatron_rl.config.schema import ParallelConfig
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.build import build_policy_trainer

    _, layout = initialize_parallel(tp=1, pp=1)
    settings = replace(_settings(path, "dapo"), parallel=ParallelConfig(distributed_optimizer=True))
    trainer, policy, spec = build_policy_trainer(settings)
    loaded = _trained_weights(policy, spec)
    groups = make_groups(spec.vocab_size)
    mine, others = groups[layout.dp_rank :: 2], groups[1 - layout.dp_rank :: 2]
    _train(trainer, mine)
    shard = _poison_a_row_in_shard_1(trainer, policy, mine, others) if layout.dp_rank == 1 else None
    result = trainer.finish_mini_batch()
    return loaded, _trained_weights(policy, spec), result.skipped, result.nonfinite, shard


def test_a_nan_in_one_replicas_optimizer_shard_skips_the_step_on_every_rank(checkpoint):  # noqa: F811
    ranks = run_distributed(_nan_in_one_shard_worker, 2, checkpoint)
    assert ranks[1][4] == 1, "the poisoned rows must live in replica 1's shard only"
    for loaded, after, skipped, nonfinite, _ in ranks:
        assert skipped and nonfinite
        for key, value in loaded.items():
            assert torch.equal(after[key], value), f"{key} changed in a skipped step"


def _tp2_worker(path):
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.build import build_policy_trainer

    initialize_parallel(tp=2, pp=1)
    trainer, _, spec = build_policy_trainer(_settings(path, "dapo"))
    _train(trainer, make_groups(spec.vocab_size))
    result = trainer.finish_mini_batch()
    return result.denominator, result.loss


def test_loss_totals_at_tp2_are_counted_once_per_replica(checkpoint):  # noqa: F811
    groups = make_groups(300)  # the tiny checkpoint's vocabulary
    tokens = sum(len(s.response_ids) for g in groups for s in g.samples)
    # On-policy (ratio 1) with no KL / entropy: every token's DAPO term is -A of its sequence.
    loss = -sum(float(a) * len(s.response_ids) for g in groups for s, a in zip(g.samples, g.advantages, strict=True))
    for denominator, got_loss in run_distributed(_tp2_worker, 2, checkpoint):
        assert denominator == tokens
        assert abs(got_loss - loss / tokens) <= 1e-6 * abs(loss / tokens)
