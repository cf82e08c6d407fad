"""Dispatch of one ``generate`` call over the supervised workers: chunks, results, exactly once.

Contract:
- Requests are cut into chunks of at most ``max_batch_size`` (spread evenly over the
  workers); each worker holds at most ``PREFETCH`` chunks, so while it decodes one the next
  is already in its pipe.
- Results are yielded in completion order, each request exactly once: a result counts only
  if its request id is still in flight on the worker that sent it.
- A worker that dies or hangs (``Supervisor.next_events``) has its unanswered requests put
  back at the front of the queue and is restarted; more than ``max_restarts`` failures in
  one call raise ``RolloutWorkerError`` (``Supervisor.count_death``).
- A Python exception inside a worker raises ``RolloutWorkerError`` naming the worker and
  its requests.
- Whatever happens, ``drain`` runs before the call returns: no command of this call is
  left outstanding, and workers that died are left for the next call to restart.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator

from megatron_rl.rollout.supervision import RolloutWorkerError, Supervisor, WorkerHandle
from megatron_rl.rollout.types import GenerationRequest, GenerationResult
from megatron_rl.rollout.worker import Done, Failed, Generate, Loaded, Result

# Generate commands queued per worker: while it decodes one chunk the next is already in its
# pipe, so it never idles waiting for the parent (whose producer thread shares a core and the
# GIL with training) to hand out more work.
PREFETCH = 2


def generate_results(sup: Supervisor, requests: list[GenerationRequest], *,
                     max_batch_size: int) -> Iterator[GenerationResult]:
    """Yield one result per request of ``requests`` (ids unique), in completion order."""
    pending = deque(requests)
    answered: set[str] = set()
    chunk = max(1, min(max_batch_size, math.ceil(len(requests) / len(sup.workers))))
    deaths = 0
    try:
        while len(answered) < len(requests):
            _dispatch(sup.workers, pending, chunk)
            for w, message in sup.next_events([w for w in sup.workers if w.busy]):
                if message is None:
                    deaths = sup.count_death(w, deaths, "generate")
                    pending.extendleft(reversed(_take_back(w)))
                    sup.restart(w)
                elif isinstance(message, Result):
                    result = message.result
                    if w.in_flight.pop(result.request_id, None) and result.request_id not in answered:
                        assert result.weight_version == sup.version, (result.weight_version, sup.version)
                        answered.add(result.request_id)
                        yield result
                elif isinstance(message, Done):
                    _finish_chunk(w)
                elif isinstance(message, Failed):
                    _fail_chunk(w, message)
    finally:
        drain(sup)


def _dispatch(workers: list[WorkerHandle], pending: deque, chunk: int) -> None:
    for w in workers:
        while pending and w.outstanding < PREFETCH:
            batch = tuple(pending.popleft() for _ in range(min(chunk, len(pending))))
            w.in_flight.update((r.request_id, r) for r in batch)
            w.chunks.append(tuple(r.request_id for r in batch))
            w.send(Generate(batch))


def _finish_chunk(w: WorkerHandle) -> None:
    w.outstanding -= 1
    missing = [rid for rid in w.chunks.popleft() if rid in w.in_flight]
    if missing:
        for rid in missing:
            del w.in_flight[rid]
        raise RolloutWorkerError(f"rollout worker {w.spec.index} finished a chunk without answering {missing}")


def _fail_chunk(w: WorkerHandle, message: Failed) -> None:
    w.outstanding -= 1
    for rid in w.chunks.popleft() if w.chunks else ():
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
        for w, message in sup.next_events(busy):
            if message is None:
                w.reset()
            elif isinstance(message, (Done, Failed, Loaded)):
                w.outstanding -= 1
                if w.chunks and not isinstance(message, Loaded):
                    for rid in w.chunks.popleft():
                        w.in_flight.pop(rid, None)
