"""DAPO over-sampling (``pipeline.oversample``, ``algorithm.oversample``): the trained groups are the
first N kept groups in prompt order, whatever order the prompts finish in and whatever was aborted.

- ``Oversampler`` alone, over random keep patterns and finishing orders: every prompt is put once
  (trained, dropped, surplus or aborted), the trained set equals ``[p for p if kept[p]][:N]``
  written out directly, no prompt of that set is ever aborted, and prompts are aborted when the
  first N kept finish early.
- The producer with a fake engine that can abort: per step, the groups the trainer gets are the
  first N kept groups (prompt order) of the same batch generated in full without over-sampling,
  with a different completion order; the late prompts were aborted, and the counters say so.
"""

from __future__ import annotations

import random

import pytest

from megatron_rl.pipeline.oversample import ABORTED, SURPLUS, TRAINED, Oversampler
from megatron_rl.pipeline.records import ScoredGroup
from tests.pipeline_fakes import (
    FakeEngine,
    FakeTrainer,
    deadline,
    make_pipeline,
    train_one_step,
)


def _group(p: int, kept: bool) -> ScoredGroup:
    import torch

    return ScoredGroup(
        step=0,
        prompt_index=p,
        prompt_id=f"p{p}",
        samples=(),
        rewards=torch.zeros(0),
        advantages=torch.zeros(0),
        kept=kept,
    )


@pytest.mark.parametrize("seed", range(40))
def test_oversampler_trains_the_first_n_kept_in_prompt_order(seed):
    rng = random.Random(seed)
    num_prompts = rng.randint(2, 12)
    target = rng.randint(1, num_prompts)
    kept = [rng.random() < 0.5 for _ in range(num_prompts)]
    want = [p for p in range(num_prompts) if kept[p]][:target]  # the batch generated in full
    o = Oversampler(target=target, num_prompts=num_prompts)
    order = list(range(num_prompts))
    rng.shuffle(order)
    put, aborted = {}, set()
    for p in order:
        if p in aborted:
            continue  # its late result is ignored by the producer
        o.finished(_group(p, kept[p]))
        settled = o.settle()
        for g in settled.groups:
            assert g.prompt_index not in put
            put[g.prompt_index] = g
        aborted.update(settled.abort)
    assert not o.waiting
    assert set(put) | aborted == set(range(num_prompts)) and not set(put) & aborted  # each prompt once
    assert sorted(p for p, g in put.items() if g.kept) == want
    assert not aborted & set(want)
    assert [p for p in range(num_prompts) if o.state[p] == TRAINED] == want
    assert o.state.count(SURPLUS) + o.state.count(ABORTED) == max(0, sum(kept) - target) + sum(
        1 for p in aborted if not kept[p]
    )


def test_oversampler_aborts_what_it_cannot_need():
    o = Oversampler(target=2, num_prompts=6)
    o.finished(_group(1, True))
    first = o.settle()  # prompt 1 is sure to be trained: only prompt 0 before it could be kept
    assert [g.prompt_index for g in first.groups] == [1] and first.abort == ()
    o.finished(_group(0, True))
    second = o.settle()  # the first two are kept: prompts 2..5 cannot be trained
    assert [g.prompt_index for g in second.groups] == [0] and second.abort == (2, 3, 4, 5)
    assert o.metrics()["control/aborted_groups"] == 4.0


class AbortableFakeEngine(FakeEngine):
    """``FakeEngine`` whose ``abort(ids)`` answers those not yet yielded with an ``abort`` result."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.aborted: set[str] = set()

    def abort(self, request_ids) -> None:
        self.aborted.update(request_ids)

    def _answer(self, req):
        from dataclasses import replace

        result = super()._answer(req)
        if req.request_id in self.aborted:
            return replace(result, response_ids=(), logprobs=(), finish_reason="abort")
        return result


def _trained_groups(engine, target: int | None, steps: int = 3) -> list[list[tuple[str, tuple]]]:
    pipe = make_pipeline(engine, num_steps=steps, dynamic_sampling=True, target_groups=target)
    trainer = FakeTrainer(engine)
    with deadline(60), pipe:
        summaries = [train_one_step(pipe, trainer) for _ in range(steps)]
    per_step: list[list] = [[] for _ in range(steps)]
    for mb in trainer.micro_batches:
        for g in mb.groups:
            per_step[mb.step].append((g.prompt_index, tuple(s.response_ids for s in g.samples)))
    return [sorted(x) for x in per_step], summaries


def test_producer_trains_the_first_kept_groups_and_aborts_the_rest():
    full, _ = _trained_groups(FakeEngine(order_seed=1), target=None)
    over_engine = AbortableFakeEngine(order_seed=2)
    over, summaries = _trained_groups(over_engine, target=2)
    assert over == [groups[:2] for groups in full]  # the first 2 kept of the full batch, prompt order
    assert all(len(groups) >= 3 for groups in full)  # so over-sampling had something to leave out
    assert over_engine.aborted  # late prompts were aborted
    aborted = [s.end.control_metrics["control/aborted_groups"] for s in summaries]
    surplus = [s.end.control_metrics["control/surplus_groups"] for s in summaries]
    assert sum(aborted) > 0 and all(a + x <= 4 for a, x in zip(aborted, surplus, strict=True))
    assert all(s.end.control_metrics["control/oversample_prompts"] == 4 for s in summaries)


DS = "algorithm.dynamic_sampling=true"


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["algorithm.oversample=0.5", DS], "must be >= 1"),
        (["algorithm.oversample=2"], "set algorithm.dynamic_sampling true"),
        ([DS, "algorithm.oversample=1.5", "trainer.prompts_per_batch=4", "trainer.mini_batches=4"], "does not divide"),
        ([DS, "algorithm.oversample=2", "environment.kind=echo"], "single_turn generator"),
        ([DS, "algorithm.oversample=2", "trainer.prompts_per_batch=40", "pipeline.queue_size=64"], "queue_size"),
    ],
)
def test_check_config_refuses_oversampling_where_it_cannot_work(tmp_path, overrides, words):
    from tests.test_config import error

    err = error(tmp_path, overrides=overrides)
    assert set(err.keys) == {"algorithm.oversample"} and words in str(err), str(err)


def test_check_config_accepts_oversampling_and_draws_more_prompts(tmp_path):
    from megatron_rl.config.oversample_rules import drawn_prompts
    from tests.test_config import load

    cfg = load(tmp_path, overrides=[DS, "algorithm.oversample=1.5", "trainer.prompts_per_batch=4"])
    assert drawn_prompts(cfg.trainer.prompts_per_batch, cfg.algorithm.oversample) == 6
    assert drawn_prompts(3, 1.1) == 4 and drawn_prompts(10, 1.1) == 11
