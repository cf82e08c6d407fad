"""A supervised pool of engine worker processes: the ``RolloutEngine`` every backend shares.

``WorkerPool`` is the public face; the work lives in three modules:

- ``supervision``: starting, watching and restarting the processes; a worker that dies, or
  stays silent for ``request_timeout_s`` with work in flight (hung: it is killed), counts as
  a failure; more than ``max_restarts`` failures in one call raise ``RolloutWorkerError``.
- ``dispatch``: one ``generate`` call: chunks, results, every request answered exactly once
  (a failed worker's unanswered requests are re-issued).
- ``weight_delivery``: a ``weight_sync.WeightUpdate`` into every worker (the transports themselves
  live in ``megatron_rl.weight_sync``).

Contract:
- ``generate`` yields one result per request, in completion order; a Python exception
  inside a worker is raised here as ``RolloutWorkerError`` naming the worker and requests.
- ``abort(request_ids)``: ends those requests of the ``generate`` call in progress that are still
  queued or running (DAPO over-sampling's surplus): each is answered once, by its own result if it
  finished first, else by one whose ``finish_reason`` is ``"abort"`` (``rollout.dispatch``).
- ``generate_stream(feed)`` is ``generate`` over a ``rollout.feed.RequestFeed`` whose requests
  arrive while it runs (multi-turn rollouts); same guarantees, one weight version throughout.
- ``load_weights(update, version)`` returns once every worker runs the new version; results
  always carry the version they were sampled with.
- ``score(requests)``: prefill-only log-probs of given tokens (``rollout.scoring``, dispatched by
  ``score_dispatch``), in request order, with the version that scored them.
- With in-flight updates (``rollout.in_flight``: the specs' ``in_flight_staleness``) an update
  does not wait for the generate call in progress: it reaches the running requests, which carry
  on at the new version (``GenerationResult.token_versions``); ``partial_metrics`` counts that.
- ``generate`` and the updates may come from different threads (stale mode: the producer
  generates batch t+1 while the trainer syncs version t+1): an update waits for the
  generate call in progress (a lock), so every batch runs on one version. That lock has no
  timeout of its own: the generate call holding it is bounded (every wait on a worker is),
  as long as its caller keeps reading the iterator or closes it.
- Workers that died while idle (or while a failed call was drained) are restarted at the
  start of the next call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.dispatch import AbortRequests, generate_results, stream_results
from megatron_rl.rollout.feed import RequestFeed
from megatron_rl.rollout.in_flight import UpdateGate
from megatron_rl.rollout.score_dispatch import score_results
from megatron_rl.rollout.scoring import ScoreRequest, ScoreResult, check_unique, in_request_order
from megatron_rl.rollout.supervision import RolloutWorkerError, Supervisor, WorkerStatus, stop_supervised
from megatron_rl.rollout.types import GenerationRequest, GenerationResult
from megatron_rl.rollout.weight_delivery import Delivery
from megatron_rl.rollout.worker import WorkerSpec
from megatron_rl.weight_sync import WeightUpdate

__all__ = ["RolloutWorkerError", "WorkerPool", "WorkerStatus"]


class WorkerPool:
    """``RolloutEngine`` over worker processes built from ``specs`` (one process per spec)."""

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        *,
        max_batch_size: int,
        max_restarts: int = RolloutConfig.max_restarts,
        start_timeout_s: float = RolloutConfig.start_timeout_s,
        request_timeout_s: float = RolloutConfig.request_timeout_s,
        sync_backend: str = "gloo",
        sync_address: str = "127.0.0.1",
        remote=None,
        initial_version: int = 0,
    ):
        """``sync_backend`` / ``sync_address``: the collective backend the workers' devices speak
        and the interface the sync groups' listeners bind to (``weight_sync.broadcast``);
        ``remote``: the ``rollout.remote.EngineHub`` that starts the workers of nodes > 0
        (closed with the pool); ``initial_version``: the version of the weights the workers start
        from (a resumed run's step, so versions keep counting optimizer steps)."""
        self._sup = Supervisor(
            specs,
            max_restarts=max_restarts,
            start_timeout_s=start_timeout_s,
            request_timeout_s=request_timeout_s,
            remote=remote,
            version=initial_version,
        )
        self._sync = Delivery(self._sup, group_backend=sync_backend, address=sync_address)
        self._sup.gate = _update_gate(specs)
        self._max_batch_size = max_batch_size
        self._lock = threading.RLock()
        self._active: int | None = None  # thread id of the generate() iteration in progress
        self._aborts = AbortRequests()  # abort(): ids for the generate() call in progress
        self._finalizer = weakref.finalize(self, stop_supervised, self._sup)
        try:
            self._sup.start_all()
        except BaseException:
            self.shutdown()
            raise

    @property
    def weight_version(self) -> int:
        """The version every worker currently runs (``initial_version``: the weights at ``model_path``)."""
        return self._sup.version

    def busy_seconds(self) -> tuple[float, ...]:
        """Per engine (worker), in index order: seconds it has had work since it started."""
        return tuple(w.busy_seconds() for w in self._sup.workers)

    def status(self) -> tuple[WorkerStatus, ...]:
        """One ``WorkerStatus`` per worker, in index order."""
        return tuple(w.status() for w in self._sup.workers)

    def generate(self, requests: Sequence[GenerationRequest]) -> Iterator[GenerationResult]:
        """Yield one result per request, in completion order (requests are validated eagerly)."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"requests: request_id {dup!r} appears more than once")
        for r in requests:
            if not r.prompt_ids:
                raise ValueError(f"requests: request {r.request_id!r} has an empty prompt")
        self._check_idle("generate")
        return self._generate(list(requests))

    def abort(self, request_ids: Iterable[str]) -> None:
        """End these requests of the ``generate`` call in progress (module doc); ids not in flight
        are ignored. Applied at the call's next wake-up: at once from the thread iterating it."""
        self._aborts.add(request_ids)

    def generate_stream(self, feed: RequestFeed) -> Iterator[GenerationResult]:
        """Yield one result per request put on ``feed`` (``rollout.feed``), in completion order,
        until it is closed and answered; holds the pool like ``generate`` (one weight version)."""
        self._check_idle("generate_stream")
        return self._generate(feed)

    def score(self, requests: Sequence[ScoreRequest]) -> tuple[ScoreResult, ...]:
        """Teacher-forced log-probs of each request's response at the current version, in request
        order (``rollout.scoring``); waits for a generate call in progress, like ``load_weights``."""
        check_unique(requests)
        self._check_idle("score")
        with self._lock, self._reading():
            self._prepare("score")
            return in_request_order(score_results(self._sup, requests), requests)

    def load_weights(self, update: WeightUpdate, version: int) -> None:
        """Load ``update`` (a ``weight_sync`` transport's message) into every worker as ``version``
        (a later one; a partial update may also complete the current one)."""
        if not isinstance(update, WeightUpdate):
            raise TypeError(f"load_weights: expected a weight_sync.WeightUpdate, got {type(update).__name__}")
        self._check_version(version, update.partial)
        if self._sup.gate is not None:  # in-flight updates: no wait for the generate call (rollout.in_flight)
            self._check_idle("load_weights")
            with self._sup.gate.updating():
                self._sync.load(update, version)
            return
        with self._lock:
            self._prepare("load_weights")
            self._sync.load(update, version)

    def partial_metrics(self) -> dict[str, float]:
        """``partial/*``: what in-flight updates did since the last call ({} when they are off)."""
        return self._sup.gate.counters.metrics() if self._sup.gate is not None else {}

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
        self._finalizer()

    def _generate(self, requests: list[GenerationRequest] | RequestFeed) -> Iterator[GenerationResult]:
        with self._lock:
            with self._reading():
                self._prepare("generate")
            self._active = threading.get_ident()
            try:
                if isinstance(requests, RequestFeed):
                    yield from stream_results(self._sup, requests, max_batch_size=self._max_batch_size)
                else:
                    self._aborts.take()  # asked before this call: nothing of it to abort
                    yield from generate_results(
                        self._sup, requests, max_batch_size=self._max_batch_size, aborts=self._aborts
                    )
            finally:
                self._active = None

    def _reading(self) -> AbstractContextManager:
        """With in-flight updates, the gate's reading side (``rollout.in_flight``); else nothing."""
        return self._sup.gate.reading() if self._sup.gate is not None else nullcontext()

    def _prepare(self, what: str) -> None:
        """Under the lock: refuse a closed or broken pool; restart workers that died idle."""
        self._check_idle(what)
        self._sup.revive()

    def _check_version(self, version: int, partial: bool) -> None:
        if version < self._sup.version or (version == self._sup.version and not partial):
            raise ValueError(f"version={version} must exceed the current weight_version {self._sup.version}")

    def _check_idle(self, what: str) -> None:
        if not self._finalizer.alive:
            raise RuntimeError(f"{what}: the rollout engine has been shut down")
        if self._sync.broken:
            raise RuntimeError(f"{what}: the rollout engine is unusable ({self._sync.broken}); shut it down")
        # Another thread's generate() is waited for (the lock); this thread's own open iterator
        # would deadlock, so it is an error.
        if self._active == threading.get_ident():
            raise RuntimeError(f"{what}: a generate() iterator of this engine is still open; exhaust or close it")


def _update_gate(specs: Sequence[WorkerSpec]) -> UpdateGate | None:
    """The gate of in-flight updates when the workers take them (``WorkerSpec.in_flight_staleness``)."""
    staleness = {s.in_flight_staleness for s in specs}
    if len(staleness) != 1:
        raise ValueError(f"workers disagree on in_flight_staleness: {sorted(staleness, key=str)}")
    (k,) = staleness
    return None if k is None else UpdateGate(k)
