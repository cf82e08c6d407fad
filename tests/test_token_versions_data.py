"""Per-token weight versions through the data path (issue 31): packing (micro-batches, split and
K-copies layouts, the device copy), shipping to another replica (pickled without its groups),
recording and replay (a recorded stale run whose samples span two versions replays with the same
per-token versions; a recording made before token_versions existed still loads), staleness
statistics per token, the refusal of a token newer than the policy, and multi-turn trajectories
(observation tokens carry their turn's version)."""

from __future__ import annotations

import json
import pickle
import queue
from concurrent.futures import Future
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.environments.base import StepResult
from megatron_rl.generation.turn_loop import LiveTrajectory, MultiTurnSettings, TurnLoop
from megatron_rl.pipeline import GroupScoring, Pipeline, Sample, StepSpan, make_micro_batch, score_group
from megatron_rl.pipeline.recording import NullEngine, item_from_json, item_to_json, read_recording
from megatron_rl.pipeline.records import split_group, unshare_prompts
from megatron_rl.pipeline.versions import staleness_stats
from megatron_rl.rollout.feed import RequestFeed
from megatron_rl.rollout.types import GenerationResult, SamplingSettings
from megatron_rl.trainer.replica import shipped
from tests.pipeline_fakes import FakeEngine, FakeTrainer, deadline, make_pipeline, train_one_step


def _sample(k: int, response: tuple[int, ...], version: int, versions=None, reward: float = 0.0) -> Sample:
    return Sample(
        prompt_id="p",
        request_id=f"0/p/{k}",
        index=k,
        prompt_ids=(1, 2),
        response_ids=response,
        behav_logprobs=tuple(-0.1 * (i + 1) for i in range(len(response))),
        weight_version=version,
        finish_reason="stop",
        reward=reward,
        token_versions=versions,
    )


def _group():
    samples = [_sample(0, (5, 6, 7, 8, 9), 3, (3, 3, 3, 4, 4), 1.0), _sample(1, (5, 6), 4), _sample(2, (7,), 2)]
    return score_group(step=4, prompt_index=0, samples=samples, scoring=GroupScoring())


WANT = [3, 3, 3, 4, 4, 4, 4, 2]


def test_packing_keeps_each_tokens_version():
    mb = make_micro_batch([_group()], policy_version=4)
    assert mb.token_versions.tolist() == WANT and mb.versions.tolist() == [3, 4, 2]
    assert mb.token_staleness.tolist() == [4 - v for v in WANT] and mb.staleness.tolist() == [1, 0, 2]
    assert mb.to(torch.device("cpu")).token_versions.tolist() == WANT
    assert unshare_prompts(mb).token_versions.tolist() == WANT  # the K-copies layout: same response order
    parts = split_group(_group(), token_budget=2 + 5)  # [prompt, r0], [prompt, r1, r2]
    packed = [make_micro_batch([p], policy_version=4).token_versions.tolist() for p in parts]
    assert packed == [WANT[:5], WANT[5:]]


def test_a_micro_batch_shipped_to_another_replica_keeps_them():
    mb = make_micro_batch([_group()], policy_version=4)
    back = pickle.loads(pickle.dumps(shipped(mb)))
    assert back.groups == () and back.token_versions.tolist() == WANT


def test_a_token_newer_than_the_policy_is_refused():
    late = score_group(
        step=4,
        prompt_index=0,
        samples=[_sample(0, (5, 6), 4, (4, 5)), _sample(1, (5,), 4, reward=1.0)],
        scoring=GroupScoring(),
    )
    with pytest.raises(ValueError, match=r"'0/p/0' has tokens newer than the policy version 4"):
        make_micro_batch([late], policy_version=4)


def test_staleness_statistics_per_token():
    st = staleness_stats([3, 4, 2], 4, token_versions=[(3, 3, 3, 4, 4), (4, 4), (2,)])
    assert (st.min, st.max, st.mean) == (0, 2, 1.0)  # per sample: its first token
    assert st.token_min == 0 and st.token_mean == pytest.approx(sum(4 - v for v in WANT) / 8)
    assert st.mixed_samples == 1
    plain = staleness_stats([3, 4], 4)
    assert (plain.token_mean, plain.mixed_samples) == (0.5, 0)


def test_recording_round_trips_token_versions_and_old_recordings_load():
    data = json.loads(json.dumps(item_to_json(_group())))
    assert [s["token_versions"] for s in data["samples"]] == [[3, 3, 3, 4, 4], None, None]
    back = item_from_json(data)
    assert back.samples[0].token_versions == (3, 3, 3, 4, 4)
    assert item_to_json(back) == item_to_json(_group())
    for s in data["samples"]:  # a recording written before token_versions existed
        del s["token_versions"]
    s = data["samples"][0]
    s["weight_version"] = 3
    old = item_from_json(data, where="old.jsonl:1")
    assert [x.token_versions for x in old.samples] == [None] * 3
    assert make_micro_batch([old], policy_version=4).token_versions.tolist() == [3] * 5 + [4, 4, 2]


class InFlightEngine(FakeEngine):
    """A fake engine whose answers to a batch ahead of its weights span two versions: the second
    half of the tokens as if the next version had been loaded while it decoded."""

    def _answer(self, req):
        result = super()._answer(req)
        step, n, v = int(req.request_id.split("/")[0]), len(result.response_ids), result.weight_version
        if v >= step or n < 2:
            return result
        return replace(result, token_versions=(v,) * (n // 2) + (v + 1,) * (n - n // 2))


def _trained(trainer: FakeTrainer) -> list[tuple]:
    """(policy version, request id, response ids, the micro-batch's per-token versions) of every
    trained response (live and replayed runs may pack them into different micro-batches)."""
    out = []
    for mb in trainer.micro_batches:
        samples = [s for g in mb.groups for s in g.samples]
        versions = mb.token_versions.split(list(mb.packed.response_lens))
        out += [
            (mb.policy_version, s.request_id, s.response_ids, tuple(v.tolist()))
            for s, v in zip(samples, versions, strict=True)
        ]
    return sorted(out)


def test_a_recorded_run_with_token_versions_replays_them(tmp_path):
    engine, rec = InFlightEngine(delay_s=0.0005), tmp_path / "live.jsonl"
    live = FakeTrainer(engine, lead=(1, 3))
    with deadline(120), make_pipeline(engine, mode="stale", max_staleness=1, num_steps=3, record=rec) as pipe:
        summaries = [train_one_step(pipe, live) for _ in range(3)]
        settings = pipe.settings
    mixed = [s for i in read_recording(rec) if type(i).__name__ == "ScoredGroup" for s in i.samples if s.token_versions]
    assert mixed and all(s.token_versions[0] < s.token_versions[-1] for s in mixed)
    assert sum(s.staleness.mixed_samples for s in summaries) == len(mixed)
    assert any(s.staleness.token_mean < s.staleness.mean for s in summaries)
    replayed = FakeTrainer(NullEngine(0))
    with (
        deadline(120),
        Pipeline.replaying(
            rec, engine=replayed.engine, settings=settings, steps=StepSpan(num_steps=3), replicas=1
        ) as pipe,
    ):
        for _ in range(3):
            train_one_step(pipe, replayed)
    assert _trained(replayed) == _trained(live)
    assert any(len(set(versions)) > 1 for *_, versions in _trained(live))


class _Runner:
    """Environment steps answered at once: an observation, then done after ``turns`` turns."""

    def __init__(self, turns: int) -> None:
        self.turns, self.calls = turns, 0

    def submit_step(self, env, model_turn, *, tag=""):
        self.calls += 1
        future: Future = Future()
        future.set_result(StepResult(observation=({"role": "tool", "content": "ok"},), done=self.calls >= self.turns))
        return future


def _result(turn: int, ids: tuple[int, ...], version: int, versions=None) -> GenerationResult:
    return GenerationResult(
        request_id=f"0/p/0/{turn}",
        prompt_ids=(1, 2),
        response_ids=ids,
        logprobs=(-0.5,) * len(ids),
        finish_reason="stop",
        weight_version=version,
        token_versions=versions,
    )


def _multi_turn(results: list[GenerationResult]):
    """Run ``results`` as the model turns of one trajectory through the turn loop's handlers."""
    settings = MultiTurnSettings(
        max_turns=4,
        max_total_tokens=100,
        encode_prompt=lambda messages, tools: [1, 2],
        encode_observation=lambda messages, tools: [90, 91, 92],
        decode=lambda ids: "x",
    )
    loop = TurnLoop(settings=settings, runner=_Runner(len(results)), sampling=SamplingSettings(), poll_s=0.01)
    traj = LiveTrajectory(key="0/p/0", p=0, k=0, env=SimpleNamespace(tools=()), prompt_ids=(1, 2), seed_of=int)
    events, feed = queue.Queue(), RequestFeed()
    for result in results:
        assert not loop._on_turn(traj, result, events)
        ended = loop._on_step(traj, events.get_nowait(), feed)
    assert ended
    return traj.finish()


def test_multi_turn_tokens_carry_their_turns_version():
    out = _multi_turn([_result(0, (5, 6, 7), 3, (3, 3, 4)), _result(1, (8, 9), 4)])
    assert out.response_ids == (5, 6, 7, 90, 91, 92, 8, 9) and out.loss_mask == (1, 1, 1, 0, 0, 0, 1, 1)
    assert out.token_versions == (3, 3, 4, 4, 4, 4, 4, 4) and out.turn_versions == (3, 4)
    between = _multi_turn([_result(0, (5,), 3), _result(1, (8, 9), 4)])  # a load between turns
    assert between.token_versions == (3, 3, 3, 3, 4, 4)
    one = _multi_turn([_result(0, (5,), 4), _result(1, (8,), 4)])
    assert one.token_versions is None  # one version throughout: the records' default


def test_agent_trajectories_carry_each_tokens_version():
    """Gateway sessions: an observation carries the version before it, the prompt's rest (after
    the group's shared prefix) the first turn's."""
    from megatron_rl.gateway.session import Branch, Plan, Session
    from megatron_rl.generation.agent import Outcome, _trajectory

    session = Session(key="0/p/0", codec=None, max_total_tokens=100, seed_of=int)
    branch = Branch(prompt_ids=(1, 2), tools_key="")
    turns = [(Plan(branch=branch, observation=(), new=True, messages=()), _result(0, (5, 6), 3, (3, 4)))]
    turns.append((Plan(branch=branch, observation=(90, 91), new=False, messages=()), _result(1, (8,), 5)))
    for plan, result in turns:
        session.commit(plan, result=result, text="x", assistant={"role": "assistant", "content": "x"}, closed_turn=True)
    assert branch.ids == [5, 6, 90, 91, 8] and branch.token_versions == [3, 4, 4, 4, 5]
    out = _trajectory(session, Outcome(), prompt=(1,), p=0, k=0)
    assert out.response_ids == (2, 5, 6, 90, 91, 8) and out.token_versions == (3, 3, 4, 4, 4, 5)
    one = Session(key="0/p/1", codec=None, max_total_tokens=100, seed_of=int)
    plan = Plan(branch=Branch(prompt_ids=(1, 2), tools_key=""), observation=(), new=True, messages=())
    one.commit(
        plan, result=_result(0, (5,), 4), text="x", assistant={"role": "assistant", "content": "x"}, closed_turn=True
    )
    assert _trajectory(one, Outcome(), prompt=(1,), p=0, k=0).token_versions is None
