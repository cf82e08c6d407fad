"""Dispatch of one ``generate`` call over the supervised workers: chunks, results, exactly once.

Contract:
- Requests are cut into chunks of at most ``max_batch_size`` (spread evenly over the
  workers); each worker holds at most ``PREFETCH`` chunks, so while it decodes one the next
  is already in its pipe. A streaming worker (``rollout.stream_worker``: its chunks join the
  engine's running batch and are answered out of order) instead takes chunks while it has
  fewer than ``PREFETCH`` x its engine's ``max_batch_size`` requests in flight.
- Results are yielded in completion order, each request exactly once: a result counts only
  if its request id is still in flight on the worker that sent it.
- A worker that dies or hangs (``Supervisor.next_events``) has its unanswered requests put
  back at the front of the queue and is restarted; more than ``max_restarts`` failures in
  one call raise ``RolloutWorkerError`` (``Supervisor.count_death``).
- A Python exception inside a worker raises ``RolloutWorkerError`` naming the worker and
  its requests.
- Routing: a whole group (requests ``"<step>/<prompt>/<k>"`` of one prompt) goes to one
  worker, the one with the fewest outstanding tokens (``outstanding_tokens``), local or on
  another node (``rollout.remote``).
- ``stream_results`` is the same over a ``RequestFeed`` (multi-turn): requests join while
  others decode, and the wait covers the feed's handle, so a new turn is dispatched at once.
- Abort (``AbortRequests``, ``WorkerPool.abort``): at each wake-up the ids asked for since the
  last are applied: a request not yet sent is answered here (a ``"abort"`` result, no token),
  one on a worker is sent an ``Abort`` (the worker answers it), one already answered is
  ignored; every request is still answered exactly once.
- Whatever happens, ``drain`` runs before the call returns: no command of this call is
  left outstanding, and workers that died are left for the next call to restart.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from megatron_rl.rollout.feed import RequestFeed
from megatron_rl.rollout.supervision import RolloutWorkerError, Supervisor, WorkerHandle
from megatron_rl.rollout.types import GenerationRequest, GenerationResult
from megatron_rl.rollout.worker import Abort, Done, Failed, Generate, Loaded, Result, aborted_result

# Generate commands queued per worker: while it decodes one chunk the next is already in its
# pipe, so it never idles waiting for the parent (whose producer thread shares a core and the
# GIL with training) to hand out more work.
PREFETCH = 2


class AbortRequests:
    """Request ids to abort, handed from any thread to the call in progress (module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: set[str] = set()

    def add(self, request_ids: Iterable[str]) -> None:
        """Ask for ``request_ids`` to be aborted at the call's next wake-up."""
        with self._lock:
            self._asked.update(request_ids)

    def take(self) -> set[str]:
        """The ids asked for since the last ``take`` (cleared)."""
        with self._lock:
            taken, self._asked = self._asked, set()
            return taken


def generate_results(
    sup: Supervisor, requests: list[GenerationRequest], *, max_batch_size: int, aborts: AbortRequests | None = None
) -> Iterator[GenerationResult]:
    """Yield one result per request of ``requests`` (ids unique), in completion order."""
    call = _Call(pending=deque(requests))
    chunk = max(1, min(max_batch_size, math.ceil(len(requests) / len(sup.workers))))
    try:
        while len(call.answered) < len(requests):
            yield from _abort(sup, call, aborts)
            _dispatch(sup.workers, call.pending, chunk)
            if any(w.busy for w in sup.workers) or sup.gate is not None:  # gate: a dead worker's orphans
                yield from _events(sup, call, ())
    finally:
        _drain_call(sup)


def stream_results(sup: Supervisor, feed: RequestFeed, *, max_batch_size: int) -> Iterator[GenerationResult]:
    """Yield one result per request put on ``feed``, in completion order, until the feed is
    closed and every request answered (or aborted). Requests are dispatched as they arrive, in
    chunks of at most ``max_batch_size`` spread over the workers; ids must be unique."""
    call, taken = _Call(pending=deque()), 0
    try:
        while True:
            new, closed, aborted = feed.take()
            if aborted:
                return
            call.pending.extend(new)
            taken += len(new)
            if closed and not call.pending and len(call.answered) == taken:
                return
            if call.pending:
                chunk = max(1, min(max_batch_size, math.ceil(len(call.pending) / len(sup.workers))))
                _dispatch(sup.workers, call.pending, chunk)
            yield from _events(sup, call, (feed.handle,))
    finally:
        _drain_call(sup)


@dataclass
class _Call:
    """The state of one generate / stream call."""

    pending: deque
    answered: set[str] = field(default_factory=set)
    deaths: int = 0
    aborting: set[str] = field(default_factory=set)  # asked to abort, not answered yet
    abort_sent: set[str] = field(default_factory=set)  # of those, sent to a worker as an Abort


def _abort(sup: Supervisor, call: _Call, aborts: AbortRequests | None) -> Iterator[GenerationResult]:
    """Apply the aborts asked for so far (module doc); yield the pending requests' answers."""
    if aborts is not None:
        call.aborting |= aborts.take()
    call.aborting -= call.answered
    if not call.aborting:
        return
    kept = [r for r in call.pending if r.request_id not in call.aborting]
    for r in [r for r in call.pending if r.request_id in call.aborting]:
        call.answered.add(r.request_id)
        yield aborted_result(r, sup.version)
    call.pending.clear()
    call.pending.extend(kept)
    for w in sup.workers:
        ids = tuple(rid for rid in w.in_flight if rid in call.aborting and rid not in call.abort_sent)
        if ids:
            call.abort_sent.update(ids)
            w.sender.send(Abort(ids))


def _events(sup: Supervisor, call: _Call, extra: tuple) -> Iterator[GenerationResult]:
    """One wait on the busy workers (and ``extra``): handle every message, yield new results."""
    if sup.gate is not None:  # in-flight updates: read under the gate (rollout.in_flight)
        yield from _gated_events(sup, call, extra)
        return
    yield from _handle(sup, call, sup.next_events([w for w in sup.workers if w.busy], extra))


def _gated_events(sup: Supervisor, call: _Call, extra: tuple) -> list[GenerationResult]:
    """``_events`` while a weight update may arrive: first what an update read for this call
    (stashed messages, a dead worker's requests), else one wait that an update's wake-up ends."""
    with sup.gate.reading():
        if sup.gate.failed:
            raise RolloutWorkerError(f"a weight update failed while this generate call ran: {sup.gate.failed}")
        stashed, orphans = sup.gate.take()
        call.pending.extendleft(reversed(orphans))
        busy = [w for w in sup.workers if w.busy]
        # what an update handed back first; a dead worker's requests are dispatched before any wait
        events = stashed if stashed or orphans else list(sup.next_events(busy, (*extra, sup.gate.wake_handle)))
        results = list(_handle(sup, call, events))
    for result in results:
        sup.gate.counters.count(result)
    return results


def _handle(sup: Supervisor, call: _Call, events) -> Iterator[GenerationResult]:
    """Handle ``(worker, message)`` events of one wait; yield the new results."""
    for w, message in events:
        if message is None:
            call.deaths = sup.count_death(w, call.deaths, "generate")
            call.pending.extendleft(reversed(_take_back(w)))
            sup.restart(w)
        elif isinstance(message, Result):
            result = message.result
            if w.in_flight.pop(result.request_id, None) and result.request_id not in call.answered:
                # in-flight updates: the first token's version, maybe older than the pool's
                assert result.weight_version == sup.version or sup.gate is not None, (
                    result.weight_version,
                    sup.version,
                )
                call.answered.add(result.request_id)
                yield result
        elif isinstance(message, Done):
            _finish_chunk(w, message)
        elif isinstance(message, Failed):
            _fail_chunk(w, message)


def _dispatch(workers: list[WorkerHandle], pending: deque, chunk: int) -> None:
    """Whole groups (their G samples share the prompt's KV cache in one engine) to the worker
    with the fewest outstanding tokens, about ``chunk`` requests per command (a larger group
    goes whole), while some worker holds fewer than ``PREFETCH`` commands."""
    while pending:
        ready = [w for w in workers if has_room(w)]
        if not ready:
            return
        w = min(ready, key=lambda w: (outstanding_tokens(w), w.spec.index))
        batch = _take_groups(pending, chunk)
        w.in_flight.update((r.request_id, r) for r in batch)
        w.chunks.append(tuple(r.request_id for r in batch))
        w.send(Generate(batch))


def has_room(w: WorkerHandle) -> bool:
    """Whether ``w`` takes another chunk now (module doc: ``PREFETCH``)."""
    if w.streaming:
        return len(w.in_flight) < PREFETCH * w.spec.max_batch_size
    return w.outstanding < PREFETCH


def group_of(request: GenerationRequest) -> str:
    """The group of a request: its id up to the last ``/`` (``"<step>/<prompt>/<k>"``)."""
    return request.request_id.rpartition("/")[0] or request.request_id


def outstanding_tokens(w: WorkerHandle) -> int:
    """Prompt plus the most new tokens of every request ``w`` has not answered yet."""
    return sum(len(r.prompt_ids) + r.sampling.max_new_tokens for r in w.in_flight.values())


def _take_groups(pending: deque, chunk: int) -> tuple[GenerationRequest, ...]:
    """Runs of same-group requests from the front of ``pending``: at least one run, more while
    they fit in ``chunk``."""
    batch: list[GenerationRequest] = []
    while pending:
        key, run = group_of(pending[0]), []
        while pending and group_of(pending[0]) == key:
            run.append(pending.popleft())
        if batch and len(batch) + len(run) > chunk:
            pending.extendleft(reversed(run))
            break
        batch += run
    return tuple(batch)


def _finish_chunk(w: WorkerHandle, message: Done) -> None:
    w.outstanding -= 1
    missing = [rid for rid in w.pop_chunk(message.request_ids) if rid in w.in_flight]
    if missing:
        for rid in missing:
            del w.in_flight[rid]
        raise RolloutWorkerError(f"rollout worker {w.spec.index} finished a chunk without answering {missing}")


def _fail_chunk(w: WorkerHandle, message: Failed) -> None:
    w.outstanding -= 1
    for rid in w.pop_chunk(message.request_ids):
        w.in_flight.pop(rid, None)
    raise RolloutWorkerError(
        f"rollout worker {w.spec.index} (pid {w.process.pid}) failed on requests "
        f"{list(message.request_ids)}:\n{message.error}"
    )


def _take_back(w: WorkerHandle) -> list[GenerationRequest]:
    lost = list(w.in_flight.values())
    w.reset()
    w.reissued += len(lost)
    return lost


def drain(sup: Supervisor) -> None:
    """Wait until no worker has a command outstanding, discarding what they still send.
    A worker that dies or hangs meanwhile is forgotten (``Supervisor.revive`` restarts it)."""
    while busy := [w for w in sup.workers if w.busy]:
        _discard(sup.next_events(busy))


def _discard(events) -> None:
    """``drain``'s bookkeeping of ``(worker, message)`` events: what they answered is forgotten."""
    for w, message in events:
        if message is None:
            w.reset()
        elif isinstance(message, (Done, Failed, Loaded)):
            w.outstanding -= 1
            if not isinstance(message, Loaded):
                for rid in w.pop_chunk(message.request_ids):
                    w.in_flight.pop(rid, None)


def _drain_call(sup: Supervisor) -> None:
    """``drain`` at the end of a call; with in-flight updates, under the gate, after what an
    update read for the call (``rollout.in_flight``)."""
    if sup.gate is None:
        drain(sup)
        return
    with sup.gate.reading():
        _discard(sup.gate.take()[0])
        drain(sup)
