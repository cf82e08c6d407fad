"""Dispatch of one ``score`` call (``rollout.scoring``) over the supervised workers.

A probe is a few sequences, so there is no chunking or prefetch: the requests are dealt
round-robin, one ``Score`` command per worker, so every worker that gets a request is measured
(a worker that skipped a weight load is caught whichever it is). A worker that dies or hangs
is restarted and its requests re-sent, within ``max_restarts`` per call; a Python exception in
a worker raises ``RolloutWorkerError``. Every answer carries the version the pool runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_rl.rollout.dispatch import drain
from megatron_rl.rollout.scoring import ScoreRequest, ScoreResult
from megatron_rl.rollout.supervision import RolloutWorkerError, Supervisor, WorkerHandle
from megatron_rl.rollout.worker import Done, Failed, Result, Score


def score_results(sup: Supervisor, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
    """One result per request (ids unique), in completion order."""
    answered: dict[str, ScoreResult] = {}
    deaths = 0
    try:
        for w, part in zip(sup.workers, _deal(requests, len(sup.workers)), strict=True):
            _send(w, part)
        while len(answered) < len(requests):
            for w, message in sup.next_events([w for w in sup.workers if w.busy]):
                if message is None:  # died or hung: restart it and send its requests again
                    deaths = sup.count_death(w, deaths, "score")
                    lost = list(w.in_flight.values())
                    w.reset()
                    sup.restart(w)
                    _send(w, lost)
                elif isinstance(message, Result) and w.in_flight.pop(message.result.request_id, None):
                    if message.result.weight_version != sup.version:
                        raise RolloutWorkerError(
                            f"rollout worker {w.spec.index} scored at version "
                            f"{message.result.weight_version}, the pool runs {sup.version}"
                        )
                    answered[message.result.request_id] = message.result
                elif isinstance(message, Done):
                    w.outstanding -= 1
                    w.chunks.clear()
                    if w.in_flight:
                        raise RolloutWorkerError(
                            f"rollout worker {w.spec.index} finished scoring without answering {list(w.in_flight)[:5]}"
                        )
                elif isinstance(message, Failed):
                    w.outstanding -= 1
                    w.reset()
                    raise RolloutWorkerError(
                        f"rollout worker {w.spec.index} failed to score {list(message.request_ids)}:\n{message.error}"
                    )
    finally:
        drain(sup)
    return list(answered.values())


def _deal(requests: Sequence[ScoreRequest], n: int) -> list[list[ScoreRequest]]:
    return [list(requests[i::n]) for i in range(n)]


def _send(w: WorkerHandle, part: list[ScoreRequest]) -> None:
    if not part:
        return
    w.in_flight.update((r.request_id, r) for r in part)
    w.chunks.append(tuple(r.request_id for r in part))
    w.send(Score(tuple(part)))
