"""``bench --scope train`` at DP = 2 trains what training would: rank 0 dispatches each
micro-batch to the replica the pipeline routes it to (``pipeline.dispatch``), so each replica
trains its own share of the batch, not a copy of all of it.

The expected share of each replica is cut by the pipeline's ``StepBatch`` (the consumer training
runs, ``Pipeline.begin_step``) from the same scored groups, in this process.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest

from megatron_rl.bench import BenchOptions, LengthDist
from tests.distributed import run_distributed
from tests.rl_fixtures import TRAIN_PLATFORM, make_tiny_rl_model, tiny_rl_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

OPTS = BenchOptions(
    scope="train",
    steps=1,
    warmup=0,
    platform=TRAIN_PLATFORM,
    seed=11,
    prompt_len=LengthDist(kind="fixed", a=16),
    response_len=LengthDist(kind="fixed", a=8),
)


def _bench_rank(config: str) -> tuple[list[list[int]], dict | None]:
    """Run the train scope; the token ids of every micro-batch this rank's replica trained."""
    from megatron_rl.bench import run_bench
    from megatron_rl.config import load_config
    from megatron_rl.trainer import replica as replica_module

    trained, train = [], replica_module.REPLICA_CALLS["train_micro_batch"]

    def spy(replica, mb) -> None:
        trained.append(mb.packed.token_ids.tolist())
        train(replica, mb)

    replica_module.REPLICA_CALLS["train_micro_batch"] = spy  # what the leader and every follower run
    result = run_bench(load_config(config, []), OPTS)
    return trained, None if result is None else dataclasses.asdict(result)


def _expected_shares(config: str, vocab_size: int) -> dict[int, list[list[int]]]:
    """Token ids of each replica's micro-batches, as training's ``StepBatch`` routes step 0."""
    from megatron_rl.bench.train_scope import SyntheticGroups, queue_items
    from megatron_rl.config import load_config
    from megatron_rl.pipeline import BatchCutting, StepBatch

    cfg = load_config(config, [])
    queue = collections.deque(queue_items(cfg, SyntheticGroups.from_config(cfg, OPTS, vocab_size), 0))
    cutting = BatchCutting(
        mini_batches=cfg.trainer.mini_batches,
        token_budget=cfg.pipeline.micro_batch_tokens,
        streamed=False,
        flush_when_idle=False,
        replicas=2,
    )
    batch = StepBatch(queue.popleft(), 0, cutting, pop=queue.popleft, queue_empty=lambda: not queue)
    shares: dict[int, list[list[int]]] = {0: [], 1: []}
    for mini_batch in batch.mini_batches():
        for mb in mini_batch:
            shares[mb.replica].append(mb.packed.token_ids.tolist())
    return shares


def test_train_scope_dp2_trains_each_replica_its_routed_share(tmp_path):
    import json

    model = make_tiny_rl_model(tmp_path / "model")
    config = str(
        tiny_rl_config(
            tmp_path,
            model,
            trainer={"prompts_per_batch": 4},
            control={"kind": "fixed", "group_size": 2},
            data={"max_prompt_tokens": 16},
            pipeline={"mode": "sync", "micro_batch_tokens": 64},
        )
    )
    (trained0, rec), (trained1, none) = run_distributed(_bench_rank, 2, config, timeout_s=600)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    expected = _expected_shares(config, vocab)
    assert expected[0] and expected[1]  # the batch is split over both replicas
    assert trained0 == expected[0] and trained1 == expected[1]
    assert none is None and rec["world"]["dp"] == 2 and rec["devices"] == 2
    assert rec["tokens"]["samples"] == 4 * 2  # the batch counted once, not once per replica
