"""Routing a step's groups to data-parallel replicas, and a replica with nothing to train.

- ``TokenRouter``: least-loaded by packed tokens, lowest index on ties; max / mean imbalance.
- ``StepBatch`` at 2 replicas (fake engine, sync and periodic, 1 and 2 mini-batches): every
  sample is trained once, on one replica; in sync mode each group goes where an independent
  replay of the least-loaded rule over prompt order puts it; ``train/dp_imbalance`` is the
  max / mean of the tokens each replica received.
- ``StepBatch`` streamed at 2 and 3 replicas with the engine never idle (every cut but the last
  is the token-budget overflow): each replica's micro-batches are exactly a written-out replay
  (least-loaded replica per arriving group, cut at the budget), every sample trained once.
- A DP rank that got no micro-batch in a mini-batch still steps with zero gradients, and the
  update equals the independent one-sequence-at-a-time reference (``test_policy_trainer``).
"""

from __future__ import annotations

import pytest

from megatron_rl.pipeline import Pipeline
from megatron_rl.pipeline.dispatch import TokenRouter
from tests.distributed import run_distributed
from tests.pipeline_fakes import FakeEngine, FakeTrainer, deadline, make_pipeline, train_one_step
from tests.test_policy_trainer import _assert_same, _reference_worker, _settings, _trained_weights, make_groups
from tests.test_policy_trainer import checkpoint as checkpoint  # noqa: F401 -- the module fixture


def test_router_picks_the_least_loaded_replica():
    router = TokenRouter(3)
    assert [router.assign(t) for t in (10, 5, 1, 3, 2, 9)] == [0, 1, 2, 2, 2, 1]
    assert router.loads == [10, 14, 6]
    assert router.imbalance() == pytest.approx(14 * 3 / 30)
    assert TokenRouter(2).imbalance() == 1.0
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        TokenRouter(0)


def _routed_pipeline(engine, replicas, **kw) -> Pipeline:
    pipe = make_pipeline(engine, **kw)
    pipe._replicas = replicas  # what build_run passes as Pipeline(replicas=layout.dp)
    return pipe


@pytest.mark.parametrize("mode", ["sync", "periodic"])
@pytest.mark.parametrize("mini_batches", [1, 2])
def test_groups_go_to_the_least_loaded_replica(mode, mini_batches):
    engine = FakeEngine(order_seed=3, delay_s=0.0002)
    trainer = FakeTrainer(engine)
    with deadline(60), _routed_pipeline(engine, 2, mode=mode, mini_batches=mini_batches, tokens=40) as pipe:
        summaries = [train_one_step(pipe, trainer) for _ in range(3)]
    seen = [s.request_id for mb in trainer.micro_batches for g in mb.groups for s in g.samples]
    assert len(seen) == len(set(seen)) == 3 * 6 * 4  # every sample trained once
    for step, summary in enumerate(summaries):
        mbs = [mb for mb in trainer.micro_batches if mb.step == step]
        loads = [sum(mb.packed.num_tokens for mb in mbs if mb.replica == r) for r in (0, 1)]
        assert min(loads) > 0
        assert summary.extra_metrics["train/dp_imbalance"] == pytest.approx(max(loads) * 2 / sum(loads))
        replica_of = {}
        for mb in mbs:
            for g in mb.groups:
                assert replica_of.setdefault(g.prompt_index, mb.replica) == mb.replica, "a group on two replicas"
        if mode == "sync":  # prompt order inside each mini-batch, loads carried over the step
            router, groups = TokenRouter(2), {g.prompt_index: g for mb in mbs for g in mb.groups}
            want = {p: router.assign(_whole_tokens(mbs, p)) for p in sorted(groups)}
            assert replica_of == want


def _whole_tokens(mbs, prompt_index) -> int:
    """Packed tokens of a whole group, from its (possibly split) parts."""
    parts = [g for mb in mbs for g in mb.groups if g.prompt_index == prompt_index]
    return len(parts[0].samples[0].prompt_ids) + sum(len(s.response_ids) for g in parts for s in g.samples)


def _empty_rank_worker(path, kind):
    """DP rank 0 trains every group; rank 1 none: it joins the step with zero gradients."""
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.pipeline.records import chunk_by_tokens, make_micro_batch
    from megatron_rl.trainer.build import build_policy_trainer

    _, layout = initialize_parallel(tp=1, pp=1)
    trainer, policy, spec = build_policy_trainer(_settings(path, kind))
    trainer.begin_batch()
    if layout.dp_rank == 0:
        for chunk in chunk_by_tokens(make_groups(spec.vocab_size), 24):
            trainer.train_micro_batch(make_micro_batch(chunk, policy_version=0))
    result = trainer.finish_mini_batch()
    return _trained_weights(policy, spec), result.skipped


def test_a_replica_without_micro_batches_still_steps_with_zero_gradients(checkpoint):  # noqa: F811
    ((ref, _),) = run_distributed(_reference_worker, 1, checkpoint, "grpo")
    for weights, skipped in run_distributed(_empty_rank_worker, 2, checkpoint, "grpo"):
        assert not skipped
        _assert_same(weights, ref)


def _arriving_groups(n: int, seed: int) -> list:
    """``n`` kept groups of step 0 (G = 2, 4..13 packed tokens each), in arrival order."""
    import random as random_lib

    import torch

    from megatron_rl.pipeline.records import Sample, ScoredGroup

    rng, out = random_lib.Random(seed), []
    for i in range(n):
        prompt = tuple(range(1, 2 + rng.randrange(3)))
        lens = [1 + rng.randrange(5) for _ in range(2)]
        samples = tuple(
            Sample(
                prompt_id=f"p{i}",
                request_id=f"0/p{i}/{k}",
                index=k,
                prompt_ids=prompt,
                response_ids=(5,) * n_k,
                behav_logprobs=(-0.5,) * n_k,
                weight_version=0,
                finish_reason="stop",
                reward=0.0,
            )
            for k, n_k in enumerate(lens)
        )
        out.append(
            ScoredGroup(
                step=0,
                prompt_index=i,
                prompt_id=f"p{i}",
                samples=samples,
                rewards=torch.zeros(2),
                advantages=torch.ones(2),
                kept=True,
            )
        )
    return out


def _expected_cuts(groups, replicas: int, budget: int) -> dict[int, list[list[str]]]:
    """Written out: least-loaded replica per arriving group, then each replica's groups in arrival
    order cut whenever the next one would pass ``budget``. Request ids per micro-batch."""
    loads, cuts = [0] * replicas, {r: [] for r in range(replicas)}
    used = [budget + 1] * replicas
    for g in groups:
        r = loads.index(min(loads))
        loads[r] += g.num_packed_tokens
        if used[r] + g.num_packed_tokens > budget:
            cuts[r].append([])
            used[r] = 0
        cuts[r][-1] += [s.request_id for s in g.samples]
        used[r] += g.num_packed_tokens
    return cuts


@pytest.mark.parametrize("replicas", [2, 3])
def test_streamed_overflow_cuts_every_replica_its_own_micro_batches(replicas):
    """Periodic mode with the engine never idle: every micro-batch but the last per replica is cut
    by the token-budget overflow, at every replica, and each holds that replica's groups only."""
    from megatron_rl.pipeline.batching import BatchCutting, StepBatch
    from megatron_rl.pipeline.records import BatchEnd, BatchStart

    groups, budget = _arriving_groups(24, seed=replicas), 20
    items = iter(
        [
            *groups,
            BatchEnd(
                step=0, group_size=2, response_lengths=(), groups_produced=24, groups_dropped=0, source_state=None
            ),
        ]
    )
    cutting = BatchCutting(mini_batches=1, token_budget=budget, streamed=True, flush_when_idle=True, replicas=replicas)
    batch = StepBatch(
        BatchStart(step=0, num_prompts=24, group_size=2),
        0,
        cutting,
        pop=lambda: next(items),
        queue_empty=lambda: False,
    )
    got = {r: [] for r in range(replicas)}
    for mini in batch.mini_batches():
        for mb in mini:
            assert mb.packed.num_tokens <= budget
            got[mb.replica].append([s.request_id for g in mb.groups for s in g.samples])
    want = _expected_cuts(groups, replicas, budget)
    assert all(len(want[r]) >= 3 for r in range(replicas)), "the overflow branch must run at every replica"
    trained = sorted(i for r in got for mb in got[r] for i in mb)
    assert trained == sorted(s.request_id for g in groups for s in g.samples)  # each sample once
    assert got == want
