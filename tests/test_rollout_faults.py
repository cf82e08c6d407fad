"""Rollout supervision under injected faults (model-free ``EchoBackend`` workers): a hung
worker is detected within ``request_timeout_s``, killed, restarted and its requests
re-issued, each request answered exactly once; repeated failures raise a clear
``RolloutWorkerError``; a failed collective is raised with its cause; the broadcast group
listens on the configured address only."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
import torch

from megatron_rl.rollout import RolloutWorkerError, WorkerPool
from megatron_rl.rollout.faults import draw, with_faults
from megatron_rl.weight_sync import broadcast as broadcast_module
from megatron_rl.weight_sync.group import open_listener
from megatron_rl.weight_sync.snapshot import SnapshotUpdate
from tests.distributed import listening_addresses
from tests.rollout_faults import echo_response, echo_specs
from tests.rollout_reference import request, sync

pytestmark = [pytest.mark.multiproc]

TIMEOUT_S = 3.0  # far above any healthy silence of an EchoBackend worker (20 ms per request)
RESTART_BOUND_S = 45.0  # spawn + torch import of one worker on a loaded 2-core machine, generously


def _pool(tmp_path, n=2, max_restarts=3, **env) -> WorkerPool:
    return WorkerPool(
        echo_specs(tmp_path, n, **env),
        max_batch_size=3,
        max_restarts=max_restarts,
        request_timeout_s=TIMEOUT_S,
        start_timeout_s=120,
    )


def _requests(n=12):
    return [request(f"r{i}", (i + 1, 2 * i + 1), max_new=4, seed=i) for i in range(n)]


def _check_exactly_once(results, reqs, version=0):
    assert Counter(r.request_id for r in results) == Counter(r.request_id for r in reqs)
    for r, q in zip(sorted(results, key=lambda r: r.request_id), sorted(reqs, key=lambda q: q.request_id), strict=True):
        assert r.response_ids == echo_response(q.prompt_ids, 4, q.sampling.seed) and r.weight_version == version


def test_hung_worker_is_restarted_and_every_request_answered_once(tmp_path):
    once = tmp_path / "once"
    once.mkdir()
    pool = _pool(tmp_path, FAULT_HANG_ON="r5", FAULT_ONCE_DIR=str(once))
    try:
        reqs = _requests()
        start = time.monotonic()
        results = list(pool.generate(reqs))
        elapsed = time.monotonic() - start
        _check_exactly_once(results, reqs)
        assert TIMEOUT_S <= elapsed < TIMEOUT_S + RESTART_BOUND_S
        status = pool.status()
        assert sum(s.restarts for s in status) == 1 and sum(s.reissued for s in status) >= 1
        assert all(s.alive and not s.in_flight for s in status)
        _check_exactly_once(list(pool.generate(reqs)), reqs)  # and the pool goes on
    finally:
        pool.shutdown()


def test_worker_that_keeps_hanging_raises_after_max_restarts(tmp_path):
    pool = _pool(tmp_path, max_restarts=1, FAULT_HANG_ON="r3")
    try:
        start = time.monotonic()
        with pytest.raises(RolloutWorkerError, match=r"failed 2 times .*hung.*'r3'.*rollout.max_restarts=1"):
            list(pool.generate(_requests()))
        assert time.monotonic() - start < 2 * TIMEOUT_S + 2 * RESTART_BOUND_S
        reqs = [r for r in _requests() if r.request_id != "r3"]
        _check_exactly_once(list(pool.generate(reqs)), reqs)  # the hung worker was replaced
    finally:
        pool.shutdown()


def test_worker_that_keeps_crashing_raises_naming_the_exit_code(tmp_path):
    pool = _pool(tmp_path, n=1, max_restarts=2, FAULT_CRASH_ON="r0")
    try:
        with pytest.raises(RolloutWorkerError, match=r"failed 3 times .*exit code 3.*max_restarts=2"):
            list(pool.generate(_requests(4)))
    finally:
        pool.shutdown()


def test_worker_hung_in_a_weight_load_is_restarted_with_the_new_version(tmp_path):
    once = tmp_path / "once"
    once.mkdir()
    pool = _pool(tmp_path, FAULT_HANG_LOAD="1", FAULT_ONCE_DIR=str(once))
    try:
        pool.load_weights(SnapshotUpdate(str(tmp_path)), version=1)
        assert pool.weight_version == 1 and sum(s.restarts for s in pool.status()) == 1
        reqs = _requests(6)
        _check_exactly_once(list(pool.generate(reqs)), reqs, version=1)
    finally:
        pool.shutdown()


@pytest.mark.parametrize("fault", ["FAULT_HANG_LOAD", "FAULT_HANG_DEVICE"])
def test_worker_hung_in_a_broadcast_sync_is_restarted_and_given_the_weights(tmp_path, fault):
    """Hung after receiving (a plain silence) or before joining the broadcast (the collective
    fails for everyone; the peer's error is explained by the hang, and the push is repeated)."""
    once = tmp_path / "once"
    once.mkdir()
    pool = _pool(tmp_path, **{fault: "1", "FAULT_ONCE_DIR": str(once)})
    try:
        start = time.monotonic()
        sync(pool, "broadcast", [("w", torch.ones(3))], 1, tmp_path)
        assert time.monotonic() - start < 3 * TIMEOUT_S + RESTART_BOUND_S
        assert pool.weight_version == 1 and sum(s.restarts for s in pool.status()) == 1
        reqs = _requests(6)
        _check_exactly_once(list(pool.generate(reqs)), reqs, version=1)
    finally:
        pool.shutdown()


def test_seeded_faults_change_restarts_never_results(tmp_path):
    """``rollout.faults`` (the chaos tool's injector): seed 6 hangs the worker on r6 and
    crashes it on r10, once each; every request is still answered once, with the same result."""
    specs = with_faults(echo_specs(tmp_path, 2), hang=0.1, crash=0.1, seed=6, marker_dir=tmp_path / "markers")
    assert [i for i in range(12) if draw(6, f"r{i}") < 0.2] == [6, 10]
    pool = WorkerPool(specs, max_batch_size=3, request_timeout_s=TIMEOUT_S, start_timeout_s=120)
    try:
        reqs = _requests()
        _check_exactly_once(list(pool.generate(reqs)), reqs)
        assert sum(s.restarts for s in pool.status()) == 2
        _check_exactly_once(list(pool.generate(reqs)), reqs)  # faults fire once per request id
        assert sum(s.restarts for s in pool.status()) == 2
    finally:
        pool.shutdown()


def test_failed_collective_is_raised_with_its_cause(tmp_path, monkeypatch):
    pool = _pool(tmp_path)
    try:
        injected = RuntimeError("injected: trainer-side broadcast failed")

        def failing_send(*args, **kwargs):
            raise injected

        monkeypatch.setattr(broadcast_module, "send_tensors", failing_send)
        with pytest.raises(RolloutWorkerError) as info:
            sync(pool, "broadcast", [("w", torch.ones(3))], 1, tmp_path)
        assert info.value.__cause__ is injected
        with pytest.raises(RuntimeError, match="unusable"):  # workers may run different weights now
            list(pool.generate(_requests(2)))
    finally:
        pool.shutdown()


def test_broadcast_group_listens_on_the_configured_address_only(tmp_path):
    assert open_listener("127.0.0.1").getsockname()[0] == "127.0.0.1"
    with pytest.raises(ValueError, match="rollout.sync_address"):
        open_listener("192.0.2.1")  # TEST-NET: not an address of this machine
    pool = _pool(tmp_path)
    try:
        sync(pool, "broadcast", [("w", torch.ones(3))], 1, tmp_path)  # the group stays up
        pids = [os.getpid(), *(s.pid for s in pool.status())]
        addresses = set().union(*(listening_addresses(pid) for pid in pids))
        assert addresses, "the sync group should hold listening sockets"
        loopback = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1 and ::1, as /proc writes them
        assert all(a.startswith(loopback) for a in addresses), addresses
        reqs = _requests(4)
        _check_exactly_once(list(pool.generate(reqs)), reqs, version=1)
    finally:
        pool.shutdown()


def test_shutdown_during_a_generate_restarts_nothing(tmp_path):
    """The pipeline shuts the engine down while its producer thread is inside generate (a stop
    request in periodic mode): the generate must end with an error, not revive the killed
    workers, which would outlive the pool and block the interpreter's exit."""
    import threading

    pool = _pool(tmp_path, FAULT_HANG_ON="r7")  # keeps one chunk busy until the shutdown kills it
    outcome = []

    def consume():
        try:
            outcome.extend(pool.generate(_requests()))
        except (RolloutWorkerError, RuntimeError) as err:
            outcome.append(err)

    thread = threading.Thread(target=consume)
    thread.start()
    time.sleep(1.0)
    pool.shutdown()
    thread.join(30)
    assert not thread.is_alive(), "generate did not end after shutdown"
    assert any(isinstance(o, Exception) for o in outcome)
    assert all(not s.alive for s in pool.status()), [s for s in pool.status() if s.alive]
