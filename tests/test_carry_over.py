"""Partial rollout's carry-over (``rollout.carry_over``, ``pipeline.carry_over``): the prompts DAPO
over-sampling aborts continue into the next batch with the tokens they had.

- ``CarryOver`` alone: which aborted prompts are kept (prompt order, capped, in multiples of the
  mini-batch count), which trajectories are dropped as too stale, the counters; ``batch_prompts``
  renames a carried prompt the next draw also holds.
- The producer with a fake engine whose abort keeps the tokens sampled so far: per step, the batch
  opens with the prompts the previous one aborted; every continued request the engine saw is the
  prompt followed by exactly the tokens its abort returned, with the budget they leave; every
  trained sample of a carried prompt is those tokens followed by the continuation's, log-probs and
  per-token versions likewise (all rebuilt here from the engine's own records); every trained
  group is complete, and no token is older than the schedule allows.
- ``check-config`` refuses carry-over where it cannot work, naming ``rollout.carry_over``.
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import replace

import pytest

from megatron_rl.generation.base import Trajectory
from megatron_rl.pipeline.carry_over import CarryOver, batch_prompts
from tests.pipeline_fakes import (
    MAX_NEW_TOKENS,
    FakeEngine,
    FakeItem,
    FakePrompts,
    FakeRecord,
    FakeTrainer,
    deadline,
    make_pipeline,
    train_one_step,
)


def _trajectory(p: int, k: int, tokens: int, version: int, reason: str = "abort") -> Trajectory:
    return Trajectory(
        request_id=f"0/p{p}/{k}", prompt_index=p, k=k, prompt_ids=(1,), response_ids=(5,) * tokens,
        loss_mask=None, behav_logprobs=(-0.5,) * tokens, turn_versions=(version,), finish_reason=reason,
        last_text="",
    )  # fmt: skip


def _item(pid: str) -> FakeItem:
    return FakeItem(record=FakeRecord(prompt_id=pid), token_ids=(1, 2))


def test_carry_over_keeps_the_first_aborted_prompts_in_multiples_and_drops_stale_ones():
    carry = CarryOver(max_prompts=3, multiple=2)
    for p in (5, 2, 4):  # aborted out of prompt order; 3 aborted, 3 allowed, 2 = the multiple kept
        carry.aborted(p, _item(f"p{p}"), {0: _trajectory(p, 0, 2, version=1, reason="stop")})
        carry.answered(p, _trajectory(p, 1, 3, version=2))
        carry.answered(p, _trajectory(p, 2, 0, version=2))  # aborted before its first token: nothing to keep
    carry.close_batch()
    batch = carry.take(min_version=2)
    assert [i.record.prompt_id for i in batch.items] == ["p2", "p4"]
    assert set(batch.trajectories) == {(0, 1), (1, 1)}  # the finished k=0 started at version 1 < 2
    assert carry.metrics() == {
        "partial/carried_prompts": 2.0,
        "partial/carried_requests": 2.0,
        "partial/carried_tokens": 6.0,
        "partial/carried_restarted": 2.0,
        "partial/carried_finished": 0.0,
    }
    assert carry.take(min_version=0).items == ()  # taken once


def test_batch_prompts_renames_a_carried_prompt_the_draw_also_holds():
    items = batch_prompts([_item("a"), _item("b")], [_item("b"), _item("c")])
    assert [i.record.prompt_id for i in items] == ["a", "b@carried", "b", "c"]


class PartialAbortEngine(FakeEngine):
    """``FakeEngine`` whose abort answers an unanswered request with the first half of its tokens
    (what a real engine had sampled so far), and which honours each request's token budget."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.aborted: set[str] = set()
        self.requests: dict[str, object] = {}  # request id -> the last request of that id

    def abort(self, request_ids) -> None:
        self.aborted.update(request_ids)

    def generate(self, requests):
        self.requests.update({r.request_id: r for r in requests})
        return super().generate(requests)

    def results_of(self, request_id: str) -> tuple[int, ...]:
        """The tokens this engine answered for ``request_id`` itself (none for a reused trajectory)."""
        return next((r.response_ids for r in self.results if r.request_id == request_id), ())

    def _answer(self, req):
        result = super()._answer(req)
        n = min(len(result.response_ids), req.sampling.max_new_tokens)
        if req.request_id in self.aborted:
            n = n // 2
        reason = "abort" if req.request_id in self.aborted else result.finish_reason
        return replace(result, response_ids=result.response_ids[:n], logprobs=result.logprobs[:n], finish_reason=reason)


def _run(engine, steps: int):
    pipe = make_pipeline(
        engine, mode="stale", max_staleness=2, prompts=FakePrompts([f"p{i}" for i in range(60)], per_batch=6),
        num_steps=steps, queue_size=256, dynamic_sampling=True, target_groups=2,
        carry_over=CarryOver(max_prompts=4, multiple=1),
    )  # fmt: skip
    trainer = FakeTrainer(engine)
    with deadline(60), pipe:
        summaries = [train_one_step(pipe, trainer) for _ in range(steps)]
    return summaries, trainer


def _expected(sample, engine, prompt_ids):
    """The sample rebuilt from the engine's records: (tokens, log-probs, per-token versions)."""
    tokens, logprobs, versions = (), (), ()
    for result in [r for r in engine.results if r.request_id.split("/", 1)[1] == sample.request_id.split("/", 1)[1]]:
        request = engine.requests[result.request_id]
        if int(result.request_id.split("/")[0]) > int(sample.request_id.split("/")[0]):
            continue
        if request.prompt_ids != prompt_ids + tokens:  # an earlier run of this prompt, not this chain
            tokens, logprobs, versions = (), (), ()
        assert request.prompt_ids == prompt_ids + tokens, result.request_id
        assert request.sampling.max_new_tokens == MAX_NEW_TOKENS - len(tokens), result.request_id
        tokens, logprobs = tokens + result.response_ids, logprobs + result.logprobs
        versions += (result.weight_version,) * len(result.response_ids)
    return tokens, logprobs, versions


@pytest.mark.parametrize("order_seed", [3, 4, 5])
def test_aborted_prompts_continue_into_the_next_batch_from_their_tokens(order_seed):
    engine = PartialAbortEngine(order_seed=order_seed)
    summaries, trainer = _run(engine, steps=4)
    carried = [s.end.control_metrics["partial/carried_prompts"] for s in summaries]
    aborted = [s.end.control_metrics["control/aborted_groups"] for s in summaries]
    assert carried[0] == 0 and all(c == min(a, 4) for c, a in zip(carried[1:], aborted, strict=False))
    assert sum(carried) > 0 and sum(s.end.control_metrics["partial/carried_tokens"] for s in summaries) > 0
    assert [s.end.groups_produced for s in summaries] == [6 + c for c in carried]
    continued = 0
    for mb in trainer.micro_batches:
        for group in mb.groups:
            assert len(group.samples) == 4 and all(s.finish_reason != "abort" for s in group.samples)
            for s in group.samples:
                tokens, logprobs, versions = _expected(s, engine, s.prompt_ids)
                assert s.response_ids == tokens and s.behav_logprobs == logprobs, s.request_id
                assert (s.token_versions or (s.weight_version,) * len(tokens)) == versions, s.request_id
                assert s.weight_version >= mb.policy_version - 2  # the schedule's bound holds
                continued += len(tokens) > len(engine.results_of(s.request_id))
    assert continued > 0  # some trained sample was continued from carried tokens


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["rollout.carry_over=true", "pipeline.mode=stale", "pipeline.max_staleness=1"], "algorithm.oversample > 1"),
        (["rollout.carry_over=true", "algorithm.dynamic_sampling=true", "algorithm.oversample=2"], "'stale'"),
        (
            ["rollout.carry_over=true", "algorithm.dynamic_sampling=true", "algorithm.oversample=1.5",
             "trainer.prompts_per_batch=2", "trainer.mini_batches=2", "pipeline.mode=stale",
             "pipeline.max_staleness=1"],
            "nothing would be carried",
        ),
    ],
)  # fmt: skip
def test_check_config_refuses_carry_over_where_it_cannot_work(tmp_path, overrides, words):
    from tests.test_config import error

    err = error(tmp_path, overrides=overrides)
    assert "rollout.carry_over" in err.keys and words in str(err), str(err)


def test_check_config_counts_carried_prompts_in_the_queue_rule(tmp_path):
    from megatron_rl.config.oversample_rules import carried_prompts
    from tests.test_config import error, load

    base = [
        "algorithm.dynamic_sampling=true",
        "algorithm.oversample=2",
        "pipeline.mode=stale",
        "algorithm.loss=ppo_decoupled",
    ]
    cfg = load(tmp_path, overrides=[*base, "pipeline.max_staleness=1", "rollout.carry_over=true"])
    assert carried_prompts(cfg) == cfg.trainer.prompts_per_batch
    err = error(tmp_path, overrides=[*base, "pipeline.max_staleness=1", "rollout.carry_over=true",
                                     "trainer.prompts_per_batch=8", "pipeline.queue_size=40"])  # fmt: skip
    assert "algorithm.oversample" in err.keys and "carried over" in str(err), str(err)


@pytest.mark.parametrize(
    "backend",
    [
        "hf",
        pytest.param(
            "vllm",
            marks=[
                pytest.mark.slow,
                pytest.mark.vllm,
                pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
            ],
        ),
    ],
)
def test_a_carried_partial_continues_on_a_real_engine_with_teacher_forced_logprobs(tmp_path, backend):
    """A response cut after 3 tokens, continued by the generator on a real engine: every token's
    behaviour log-prob (carried and new) equals a transformers teacher-forced forward."""
    from megatron_rl.generation import SingleTurnGenerator
    from megatron_rl.generation.base import BatchRequest
    from megatron_rl.rollout import SamplingSettings, build_engine
    from tests.hf_models import make_tiny_hf
    from tests.rl_fixtures import teacher_forced_logprobs
    from tests.rollout_reference import engine_settings, request, run_all

    model = make_tiny_hf(tmp_path / "qwen2", "qwen2", seed=3, layers=2)
    settings = engine_settings(backend, model, request_timeout_s=300.0)
    engine = build_engine(replace(settings, vllm={"max_model_len": 512}) if backend == "vllm" else settings)
    item = FakeItem(record=FakeRecord(prompt_id="q"), token_ids=(5, 17, 42, 9))
    try:
        cut = run_all(engine, [request("0/q/0", item.token_ids, max_new=3, seed=11)])["0/q/0"]
        prior = Trajectory(
            request_id=cut.request_id, prompt_index=0, k=0, prompt_ids=item.token_ids, response_ids=cut.response_ids,
            loss_mask=None, behav_logprobs=cut.logprobs, turn_versions=(0,), finish_reason="abort", last_text="",
        )  # fmt: skip
        generator = SingleTurnGenerator(sampling=SamplingSettings(max_new_tokens=12), detokenize=str)
        batch = BatchRequest(step=1, items=(item,), group_size=1, base_seed=0, carried={(0, 0): prior})
        (done,) = generator.run(engine, batch, stop=threading.Event(), check_version=lambda rid, v: None)
    finally:
        engine.shutdown()
    assert done.response_ids[:3] == cut.response_ids and len(done.response_ids) > 3
    assert len(done.response_ids) <= 12 and done.request_id == "1/q/0"
    (ref,) = teacher_forced_logprobs(model, [(item.token_ids, done.response_ids)])
    assert max(abs(a - b) for a, b in zip(done.behav_logprobs, ref, strict=True)) <= 1e-4
