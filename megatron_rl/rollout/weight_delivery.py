"""Delivery of a ``weight_sync.WeightUpdate`` to the supervised workers of a pool: the
``weight_sync.base.Fanout`` every transport's update delivers itself through.

Contract:
- ``load(update, version)`` sets the version a (re)started worker reports and what it loads
  at start (``update.at_start()``), then runs ``update.deliver(self)``; it returns once every
  worker answered ``Loaded``. A worker restarted later, between syncs, is handed to
  ``update.after_restart``.
- ``run(commands, what, collective)``: send each worker its ``WorkerLoad`` (as
  ``worker.Receive``), run this process's side of a collective, then wait until every worker
  answered or failed. Every wait is bounded: a silent worker by ``request_timeout_s``
  (``Supervisor``), a collective by the group's own timeout.
- A failure that leaves workers on different weights (a worker's exception, or a collective
  that failed in this process while every worker stayed alive) raises ``RolloutWorkerError``
  with the cause chained, and sets ``broken``: the pool refuses further calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from megatron_rl.rollout.dispatch import drain
from megatron_rl.rollout.supervision import RolloutWorkerError, Supervisor, WorkerHandle
from megatron_rl.rollout.worker import Done, Failed, Loaded, Receive, Result
from megatron_rl.weight_sync import WeightUpdate


class Delivery:
    """Moves weight updates into the workers of ``sup`` (see module doc)."""

    def __init__(self, sup: Supervisor, *, group_backend: str, address: str):
        self._sup = sup
        self.group_backend = group_backend  # gloo / nccl / hccl: what the workers' devices speak
        self.address = address  # the interface sync groups' listeners bind to
        self._current: WeightUpdate | None = None  # the last update (a restarted worker may need it)
        self._delivering = False  # restarts meanwhile are the update's own business
        self.broken: str | None = None  # set when workers may run different weights
        sup.on_restart = self._after_restart

    @property
    def workers(self) -> list[WorkerHandle]:
        return self._sup.workers

    @property
    def version(self) -> int:
        return self._sup.version

    @property
    def timeout_s(self) -> float:
        return self._sup.request_timeout_s

    @property
    def max_restarts(self) -> int:
        return self._sup.max_restarts

    def load(self, update: WeightUpdate, version: int) -> None:
        self._sup.version, self._sup.start_load = version, update.at_start()
        self._current = update
        self._guarded(lambda: update.deliver(self))

    def _after_restart(self, w: WorkerHandle) -> None:
        if self._current is not None and not self._delivering:
            self._guarded(lambda: self._current.after_restart(self, w))

    def _guarded(self, call: Callable[[], None]) -> None:
        self._delivering = True
        try:
            call()
        finally:
            self._delivering = False

    def run(self, commands: dict, what: str, collective: Callable[[], None] | None = None) -> list[WorkerHandle]:
        """Send each worker its load, run this process's side of ``collective``, then wait
        until every worker has answered or failed. Dead or hung workers are restarted and
        returned. The verdict waits for every worker: in a collective, a worker's error is
        often a peer's hang, which only its deadline reveals (the caller then repeats it)."""
        for w, load in commands.items():
            w.send(Receive(load, self._sup.version))
        collective_error = _run_collective(collective, commands, self._sup.request_timeout_s)
        restarted, failed = self._await(commands, what)
        if restarted and collective is not None:
            return restarted  # the group lost a member: the caller repeats the push
        if failed:
            self.fail(failed[0], collective_error)
        if collective_error is not None:
            self.fail(
                f"{what}: the collective failed in the trainer process while every worker answered: {collective_error}",
                collective_error,
            )
        return restarted

    def _await(self, commands: dict, what: str) -> tuple[list[WorkerHandle], list[str]]:
        deaths, restarted, failed, waiting = 0, [], [], set(commands)
        while waiting:
            for w, message in self._sup.next_events(list(waiting)):
                if self._sup.gate is not None and _for_generate(w, message):  # rollout.in_flight
                    self._sup.gate.stash(w, message)
                elif message is None:
                    deaths = self._sup.count_death(w, deaths, what)
                    if self._sup.gate is not None:  # its requests go back to the generate call
                        self._sup.gate.orphan(list(w.in_flight.values()))
                    w.reset()
                    waiting.discard(w)
                    self._sup.restart(w)
                    restarted.append(w)
                elif isinstance(message, (Loaded, Failed)):
                    w.outstanding -= 1
                    waiting.discard(w)
                    if isinstance(message, Failed):
                        failed.append(f"rollout worker {w.spec.index} failed to {what}:\n{message.error}")
                    elif self._sup.gate is not None:
                        self._sup.gate.counters.stale_restarts += message.stale_restarts
        return restarted, failed

    def fail(self, message: str, cause: BaseException | None) -> None:
        drain(self._sup)
        self.broken = f"{message.splitlines()[0]} (version {self._sup.version})"
        raise RolloutWorkerError(message) from cause

    def give_up(self, message: str) -> None:
        raise RolloutWorkerError(message)


def _for_generate(w: WorkerHandle, message: object) -> bool:
    """In-flight updates: a message of the generate call in progress, read by an update
    (a Result, a Done, or a Failed naming requests the worker still holds)."""
    if isinstance(message, (Result, Done)):
        return True
    return isinstance(message, Failed) and any(rid in w.in_flight for rid in message.request_ids)


def _run_collective(collective: Callable[[], None] | None, commands: dict, timeout_s: float) -> RuntimeError | None:
    """Run this process's side of a collective; return its error, recorded for the caller
    (a member that died or hung is found by the wait that follows, which explains it)."""
    if collective is None:
        return None
    error = None
    try:
        collective()
    except RuntimeError as err:  # torch.distributed errors (DistError, gloo) are RuntimeErrors
        error = err
    # The workers were in the collective with this process until now: the hang clock restarts
    # here. After a failure, a worker still inside the collective notices only at the group's
    # own timeout (``timeout_s``), so it gets that long on top to report before it counts as hung.
    start = time.monotonic() + (timeout_s if error is not None else 0.0)
    for w in commands:
        w.last_heard = start
    return error
