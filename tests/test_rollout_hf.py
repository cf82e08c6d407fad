"""The ``hf`` rollout engine in worker processes, what is particular to it: workers pinned to
their cores, a worker exception naming the worker and the request, settings refused, an abandoned
iterator, requests joining a running stream. The contract every engine keeps (sampling, log-probs,
weight sync, a killed worker) is tested once for all backends in ``test_engine_contract.py``."""

from __future__ import annotations

import os

import pytest

from megatron_rl.rollout import EngineSettings, RolloutEngine, RolloutWorkerError, build_engine
from tests.hf_models import make_tiny_hf
from tests.rollout_reference import (
    engine_settings,
    request,
    run_all,
)

pytestmark = [pytest.mark.multiproc]

PROMPTS = [(5, 17, 42), (100, 3, 250, 7, 9, 31, 64), (11, 12)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("rollout_hf") / "qwen2", "qwen2", seed=3, layers=2)


@pytest.fixture(scope="module")
def engine(hf_dir):
    eng = build_engine(engine_settings("hf", hf_dir))
    yield eng
    eng.shutdown()


def test_engine_is_a_rollout_engine_pinned_to_its_cores(engine):
    assert isinstance(engine, RolloutEngine)
    for status, core in zip(engine.status(), (min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))), strict=True):
        assert status.alive and os.sched_getaffinity(status.pid) == {core}


def test_worker_exception_names_worker_and_request(engine):
    bad = request("bad-token", (1, 2, 10_000), max_new=2)  # id beyond the vocabulary of 300
    with pytest.raises(RolloutWorkerError, match=r"rollout worker \d .*bad-token"):
        list(engine.generate([bad]))
    assert len(run_all(engine, [request("after", (1, 2), max_new=2)])) == 1  # the pool is still usable


def test_bad_requests_and_settings(engine, hf_dir):
    with pytest.raises(ValueError, match="rollout.devices"):
        build_engine(EngineSettings(dtype="float32", model_path=str(hf_dir), num_engines=2, devices=("cpu:0",)))
    with pytest.raises(ValueError, match="rollout.engine"):
        build_engine(EngineSettings(dtype="float32", engine="sglang", model_path=str(hf_dir)))


def test_abandoned_iterator_leaves_the_pool_clean(engine):
    reqs = [request(f"a{i}", p, max_new=6, seed=i) for i, p in enumerate(PROMPTS)]
    stream = engine.generate(reqs)
    next(stream)
    with pytest.raises(RuntimeError, match="still open"):
        engine.generate(reqs)
    stream.close()  # drains the workers: nothing of this call leaks into the next
    assert {r.request_id for r in run_all(engine, reqs).values()} == {r.request_id for r in reqs}


def test_stream_takes_requests_while_generating(engine):
    """generate_stream: a request put after the first result is answered in the same call; every
    result equals the same seeded request run through generate (per-request seeds)."""
    from megatron_rl.rollout.feed import RequestFeed

    first = [request(f"s{i}", p, max_new=5, seed=i) for i, p in enumerate(PROMPTS)]
    later = request("later", (7, 8, 9), max_new=4, seed=9)
    feed = RequestFeed()
    for r in first:
        feed.put(r)
    got = {}
    for result in engine.generate_stream(feed):
        if not got:  # the engine is busy with the others: the next turn joins them
            feed.put(later)
            feed.close()
        got[result.request_id] = result
    expected = run_all(engine, [*first, later])
    assert set(got) == set(expected)
    for rid, result in got.items():
        assert result.response_ids == expected[rid].response_ids
    empty = RequestFeed()
    empty.close()
    assert list(engine.generate_stream(empty)) == []
    with pytest.raises(RuntimeError, match="after close"):
        empty.put(later)
