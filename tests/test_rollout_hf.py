"""The ``hf`` rollout engine in worker processes: sampling contract, weight sync against the
megatron trainer model, version stamps, supervision (killed worker, worker exception)."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest
import torch

from megatron_rl.rollout import EngineSettings, RolloutEngine, RolloutWorkerError, build_engine
from megatron_rl.weight_sync.snapshot import SnapshotUpdate
from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf
from tests.rollout_reference import (
    greedy_gap,
    hf_teacher_forced_logprobs,
    request,
    run_all,
    trainer_update,
)

pytestmark = [pytest.mark.multiproc]

PROMPTS = [(5, 17, 42), (100, 3, 250, 7, 9, 31, 64), (11, 12)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("rollout_hf") / "qwen2", "qwen2", seed=3, layers=2)


@pytest.fixture(scope="module")
def engine(hf_dir):
    cores = sorted(os.sched_getaffinity(0))
    devices = (f"cpu:{cores[0]}", f"cpu:{cores[-1]}")
    eng = build_engine(EngineSettings(dtype="float32", engine="hf", model_path=str(hf_dir), num_engines=2,
                                      devices=devices, max_batch_size=3))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def pristine_engine(hf_dir):
    """An engine no test syncs: it always runs the checkpoint's weights, whatever the test order."""
    eng = build_engine(EngineSettings(dtype="float32", engine="hf", model_path=str(hf_dir), max_batch_size=3))
    yield eng
    eng.shutdown()


def test_engine_is_a_rollout_engine_pinned_to_its_cores(engine):
    assert isinstance(engine, RolloutEngine)
    for status, core in zip(engine.status(), (min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))), strict=True):
        assert status.alive and os.sched_getaffinity(status.pid) == {core}


def test_same_seed_same_sample_whatever_the_batch(engine):
    probe = request("probe", (8, 9, 10, 11), temperature=0.9, top_p=0.8, max_new=10, seed=123)
    alone = run_all(engine, [probe])["probe"]
    others = [request(f"o{i}", p, temperature=1.0, max_new=4 + i, seed=i) for i, p in enumerate(PROMPTS)]
    crowded = run_all(engine, [*others, probe])["probe"]
    assert crowded.response_ids == alone.response_ids
    torch.testing.assert_close(torch.tensor(crowded.logprobs), torch.tensor(alone.logprobs), rtol=0, atol=1e-5)
    other_seed = run_all(engine, [request("x", probe.prompt_ids, temperature=0.9, top_p=0.8, max_new=10, seed=124)])
    assert other_seed["x"].response_ids != alone.response_ids


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_equal_teacher_forced_hf_forward(pristine_engine, hf_dir, temperature):
    engine = pristine_engine
    assert engine.weight_version == 0
    reqs = [request(f"r{i}", p, temperature=temperature, max_new=8, seed=10 + i) for i, p in enumerate(PROMPTS)]
    for r in run_all(engine, reqs).values():
        ref, argmax = hf_teacher_forced_logprobs(hf_dir, r.prompt_ids, r.response_ids, temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), ref, rtol=0, atol=1e-4)
        if temperature == 0.0:
            assert r.response_ids == tuple(argmax.tolist())


def test_stop_tokens_and_max_new_tokens(engine):
    free = run_all(engine, [request("free", PROMPTS[1], temperature=0.0, max_new=12)])["free"]
    assert free.finish_reason == "length" and len(free.response_ids) == 12
    stop = free.response_ids[4]
    first = free.response_ids.index(stop)
    got = run_all(engine, [request("stop", PROMPTS[1], temperature=0.0, max_new=12, stop=(299, stop)),
                        request("short", PROMPTS[1], temperature=0.0, max_new=2)])
    assert got["stop"].finish_reason == "stop"
    assert got["stop"].response_ids == free.response_ids[:first + 1]
    assert got["short"].finish_reason == "length" and got["short"].response_ids == free.response_ids[:2]
    assert len(got["stop"].logprobs) == len(got["stop"].response_ids)


def test_worker_exception_names_worker_and_request(engine):
    bad = request("bad-token", (1, 2, 10_000), max_new=2)  # id beyond the vocabulary of 300
    with pytest.raises(RolloutWorkerError, match=r"rollout worker \d .*bad-token"):
        list(engine.generate([bad]))
    assert len(run_all(engine, [request("after", (1, 2), max_new=2)])) == 1  # the pool is still usable


def test_bad_requests_and_settings(engine, hf_dir):
    with pytest.raises(ValueError, match="request_id 'a'"):
        engine.generate([request("a", (1,)), request("a", (2,))])
    with pytest.raises(ValueError, match="rollout.devices"):
        build_engine(EngineSettings(dtype="float32", model_path=str(hf_dir), num_engines=2, devices=("cpu:0",)))
    with pytest.raises(ValueError, match="rollout.engine"):
        build_engine(EngineSettings(dtype="float32", engine="sglang", model_path=str(hf_dir)))
    with pytest.raises(ValueError, match="version=0 must exceed"):
        engine.load_weights(SnapshotUpdate(str(hf_dir)), version=0)


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


@pytest.fixture(scope="module")
def synced(engine, hf_dir, tmp_path_factory):
    """Trainer step -> snapshot -> load_weights(version 1); returns the megatron reference."""
    snap = tmp_path_factory.mktemp("snapshots") / "step1"
    (reference,) = run_distributed(trainer_update, 1, str(hf_dir), str(snap), PROMPTS, 6)
    engine.load_weights(SnapshotUpdate(str(snap)), version=1)
    return reference


def test_weight_sync_matches_trainer_model(engine, synced):
    assert engine.weight_version == 1
    assert greedy_gap(engine, PROMPTS, synced, version=1) <= 1e-4


def test_killed_worker_mid_batch(engine, synced):
    reqs = [request(f"k{i}", PROMPTS[i % 3] + (i,), temperature=1.0, max_new=40, seed=i) for i in range(12)]
    expected = run_all(engine, reqs)
    restarts_before = sum(s.restarts for s in engine.status())
    stream = engine.generate(reqs)
    results = [next(stream)]
    victim = max(engine.status(), key=lambda s: len(s.in_flight))
    assert victim.in_flight, "no worker had requests in flight"
    os.kill(victim.pid, signal.SIGKILL)
    results += list(stream)
    assert Counter(r.request_id for r in results) == Counter(r.request_id for r in reqs)  # each exactly once
    after = engine.status()[victim.index]
    assert after.restarts == victim.restarts + 1 and after.pid != victim.pid and after.reissued > victim.reissued
    assert sum(s.restarts for s in engine.status()) == restarts_before + 1
    for r in results:  # the restarted worker runs version 1 too: same samples as without the kill
        assert r.weight_version == 1
        assert r.response_ids == expected[r.request_id].response_ids
