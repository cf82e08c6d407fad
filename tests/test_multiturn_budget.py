"""Multi-turn token budget at its edge (``environment.max_total_tokens``), with a scripted
streaming engine and environment (no processes): an observation that would leave no room for
one more model token ends the trajectory as ``truncated`` on its last model token, and no turn
is ever asked for fewer than one new token.

Numbers: prompt 10 tokens, budget 30, every model turn 4 tokens ("stop") unless its
``max_new_tokens`` is smaller. After turn 0, 16 tokens are left.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from multiprocessing.connection import wait

import pytest

from megatron_rl.environments.base import StepResult
from megatron_rl.generation import GroupStart, MultiTurnGenerator, MultiTurnSettings
from megatron_rl.rollout.feed import RequestFeed
from megatron_rl.rollout.types import GenerationRequest, GenerationResult, SamplingSettings

PROMPT, BUDGET, TURN, MAX_NEW = 10, 30, 4, 8
LEFT_AFTER_TURN_0 = BUDGET - PROMPT - TURN  # 16


class ScriptedEngine:
    """``generate_stream``: answers each request with ``min(TURN, max_new_tokens)`` tokens and
    keeps every request it was sent."""

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []

    def generate_stream(self, feed: RequestFeed):
        answered = 0
        while True:
            wait([feed.handle], timeout=0.05)
            taken, closed, aborted = feed.take()
            for request in taken:
                self.requests.append(request)
                n = min(TURN, request.sampling.max_new_tokens)
                yield GenerationResult(
                    request_id=request.request_id,
                    prompt_ids=request.prompt_ids,
                    response_ids=(7,) * n,
                    logprobs=(-0.5,) * n,
                    finish_reason="stop" if n == TURN else "length",
                    weight_version=0,
                )
            answered += len(taken)
            if aborted or (closed and answered == feed.put_count):
                return


class Env:
    """Never done; each step observes ``obs_len`` tokens (see ``_encode_observation``)."""

    tools = ()

    def __init__(self, obs_len: int) -> None:
        self.obs_len = obs_len


class InlineRunner:
    """Environment calls run on the caller's thread; their futures are already done."""

    def submit_reset(self, env, record, *, tag=""):
        return _done([{"role": "user", "content": "q"}])

    def submit_step(self, env, model_turn, *, tag=""):
        return _done(StepResult(observation=({"role": "tool", "content": "o", "n": env.obs_len},), done=False))


def _done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


def _encode_observation(messages, tools):
    return tuple(range(100, 100 + sum(m["n"] for m in messages)))


def _rollout(obs_len: int):
    settings = MultiTurnSettings(
        max_turns=5,
        max_total_tokens=BUDGET,
        encode_prompt=lambda messages, tools: tuple(range(1, PROMPT + 1)),
        encode_observation=_encode_observation,
        decode=lambda ids: "t" * len(ids),
    )
    multi = MultiTurnGenerator(
        settings=settings,
        env_factory=lambda: Env(obs_len),
        runner=InlineRunner(),
        sampling=SamplingSettings(max_new_tokens=MAX_NEW),
        poll_s=0.01,
    )
    engine = ScriptedEngine()
    start = GroupStart(base="0/p0", fields={}, seed=lambda k, turn: 10 * k + turn)
    (traj,) = multi.run_groups(engine, [start], 1, stop=threading.Event(), check_version=lambda rid, v: None)
    return traj, engine.requests


@pytest.mark.parametrize("obs_len", [LEFT_AFTER_TURN_0, LEFT_AFTER_TURN_0 + 1])
def test_an_observation_that_fills_the_budget_ends_the_trajectory(obs_len):
    traj, requests = _rollout(obs_len)
    assert [r.sampling.max_new_tokens for r in requests] == [MAX_NEW]  # turn 0 only, never a 0-token turn
    assert traj.truncated and traj.turns == 1 and traj.finish_reason == "stop"
    assert traj.response_ids == (7,) * TURN and traj.loss_mask == (1,) * TURN  # the observation not appended


def test_an_observation_one_token_short_of_the_budget_leaves_a_one_token_turn():
    traj, requests = _rollout(LEFT_AFTER_TURN_0 - 1)
    assert [r.sampling.max_new_tokens for r in requests] == [MAX_NEW, 1]
    assert requests[1].prompt_ids == tuple(range(1, PROMPT + 1)) + (7,) * TURN + tuple(range(100, 115))
    assert traj.truncated and traj.turns == 2 and traj.finish_reason == "length"
    assert len(traj.prompt_ids) + len(traj.response_ids) == BUDGET
    assert traj.loss_mask == (1,) * TURN + (0,) * (LEFT_AFTER_TURN_0 - 1) + (1,)
