"""The streaming worker protocol (``rollout.stream_worker``) and the pool's side of it, without a
model: ``SteppedEcho`` finishes request r after ``max_new_tokens`` engine steps of ``STEP_S`` with
``tests.rollout_faults.echo_response``. Requests join the running batch between steps, each is
answered as it finishes (a command's Done out of order), every request exactly once with its
echo, and a worker that dies mid-stream has its requests re-issued to its restart.
(The same against vLLM: ``test_vllm_stream.py``.)"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from dataclasses import replace

import pytest

from megatron_rl.rollout import WorkerPool
from megatron_rl.rollout.feed import RequestFeed
from tests.rollout_faults import _maybe_fault, echo_response, echo_specs
from tests.rollout_reference import request

pytestmark = [pytest.mark.multiproc]

STEP_S = 0.005


class SteppedEcho:
    """A ``StreamingBackend`` without a model (module doc); faults as ``rollout_faults``."""

    streams_requests = True
    device = "cpu"

    def __init__(self, spec) -> None:
        self._running: dict[str, list] = {}  # request id -> [request, steps left, version]

    def load_tensors(self, named_tensors) -> None:
        for _ in named_tensors:
            pass

    def submit(self, requests, weight_version: int) -> None:
        for r in requests:
            self._running[r.request_id] = [r, r.sampling.max_new_tokens, weight_version]

    def step(self) -> list:
        from megatron_rl.rollout import GenerationResult

        time.sleep(STEP_S)
        done = []
        for rid, entry in list(self._running.items()):
            _maybe_fault(rid)
            entry[1] -= 1
            if entry[1] == 0:
                r, _, version = self._running.pop(rid)
                response = echo_response(r.prompt_ids, r.sampling.max_new_tokens, r.sampling.seed or 0)
                done.append(
                    GenerationResult(
                        request_id=rid,
                        prompt_ids=r.prompt_ids,
                        response_ids=response,
                        logprobs=(-1.0,) * len(response),
                        finish_reason="length",
                        weight_version=version,
                    )
                )
        return done

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def abort_all(self) -> None:
        self._running.clear()


@pytest.fixture
def pool_of(tmp_path):
    pools = []

    def make(**env: str) -> WorkerPool:
        specs = [replace(s, backend="tests.test_stream_worker:SteppedEcho") for s in echo_specs(tmp_path, 1, **env)]
        pools.append(WorkerPool(specs, max_batch_size=4, request_timeout_s=30.0))
        return pools[-1]

    yield make
    for p in pools:
        p.shutdown()


def check_echoes(results, requests) -> None:
    assert Counter(r.request_id for r in results) == Counter(r.request_id for r in requests)  # each once
    for r, q in zip(
        sorted(results, key=lambda r: r.request_id), sorted(requests, key=lambda q: q.request_id), strict=True
    ):
        assert r.response_ids == echo_response(q.prompt_ids, q.sampling.max_new_tokens, q.sampling.seed or 0)


def test_requests_join_the_running_batch_and_leave_as_they_finish(pool_of):
    pool = pool_of()
    reqs = [request(f"0/p{i}/0", (i + 1, 2), max_new=n, seed=i) for i, n in enumerate((80, 10, 50, 1, 30, 120))]
    results = list(pool.generate(reqs))  # commands {p0..p3} then {p4, p5}, both sent at once
    check_echoes(results, reqs)
    order = [r.request_id for r in results]
    assert [rid for rid in order if rid < "0/p4"] == ["0/p3/0", "0/p1/0", "0/p2/0", "0/p0/0"]  # as each finished
    assert order.index("0/p4/0") < order.index("0/p0/0") and order[-1] == "0/p5/0"  # Dones out of command order
    long, short = request("long", (1,), max_new=400), request("short", (2,), max_new=3)
    feed, streamed = RequestFeed(), []
    thread = threading.Thread(target=lambda: streamed.extend(pool.generate_stream(feed)), daemon=True)
    thread.start()
    feed.put(long)
    while pool.status()[0].in_flight != ("long",):
        time.sleep(0.01)
    feed.put(short)
    feed.close()
    thread.join(60)
    assert [r.request_id for r in streamed] == ["short", "long"]
    check_echoes(streamed, [long, short])


def test_a_worker_dead_mid_stream_has_its_requests_reissued(pool_of, tmp_path):
    (tmp_path / "once").mkdir()
    pool = pool_of(FAULT_CRASH_ON="r1", FAULT_ONCE_DIR=str(tmp_path / "once"))
    pid = pool.status()[0].pid
    reqs = [request(f"r{i}", (i, 5), max_new=20 + i, seed=i) for i in range(6)]
    results = list(pool.generate(reqs))
    check_echoes(results, reqs)
    after = pool.status()[0]
    assert after.restarts == 1 and after.pid != pid and after.reissued >= 2 and not after.in_flight
    assert os.path.exists(tmp_path / "once" / "crash-r1")  # the fault did fire
