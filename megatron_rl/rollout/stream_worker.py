"""The serve loop of a streaming worker: the engine runs step by step and takes new requests
between steps, so turns of different trajectories share its continuous batch.

A chunked worker (``worker._serve``) runs each Generate command to its end before it reads
the next: a turn submitted while a long chunk decodes waits for the whole chunk. Here:

- between two engine steps the pipe is polled without blocking; every Generate command waiting
  there is added to the running batch at once (when the engine is idle the loop blocks on the
  pipe instead: no busy wait);
- each request's ``Result`` is sent as soon as the engine finished it, and a command's
  ``Done(request_ids)`` as soon as its last request was answered, so Dones come out of order
  (the pool matches them by their ids);
- Receive and Score commands run only with the engine idle (the pool never sends them while a
  Generate is outstanding; one that does arrive waits until the batch has drained), but for a
  backend with in-flight updates on (``rollout.in_flight``), which loads a Receive between two
  steps: the running requests are paused, the update loaded, and they resume at the new version;
- an engine error fails every command in flight (one ``Failed`` each) and aborts its requests;
- an ``Abort(ids)`` is handled as soon as it is read (between steps): the backend drops those
  still running or waiting (``abort``) and each is answered by its ``"abort"`` result, then its
  command's Done if that was its last request; an id already answered is ignored.

Each request carries its own seed (``SamplingSettings.seed``): a sample does not depend on what
else is in the batch, nor on when it joined.
"""

from __future__ import annotations

import traceback
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from megatron_rl.rollout.types import GenerationRequest, GenerationResult
from megatron_rl.rollout.worker import (
    Abort,
    Done,
    Failed,
    Generate,
    Receive,
    Result,
    Stop,
    WorkerBackend,
    handle_command,
)


class StreamingBackend(WorkerBackend, Protocol):
    """A ``WorkerBackend`` whose class sets ``streams_requests = True`` and can be stepped."""

    def submit(self, requests: Sequence[GenerationRequest], weight_version: int) -> None:
        """Add ``requests`` to the running batch; their results will carry ``weight_version``."""
        ...

    def step(self) -> list[GenerationResult]:
        """Run one engine step; return the requests it finished (possibly none)."""
        ...

    def has_unfinished(self) -> bool:
        """Whether some submitted request is not finished yet."""
        ...

    def abort_all(self) -> None:
        """Drop every unfinished request (after an error)."""
        ...

    def abort(self, request_ids: set[str]) -> list[GenerationResult]:
        """Drop the unfinished requests among ``request_ids``; one ``"abort"`` result for each."""
        ...


class _Open:
    """The Generate commands in flight: which requests each still waits for."""

    def __init__(self) -> None:
        self.commands: dict[tuple[str, ...], set[str]] = {}
        self.owner: dict[str, tuple[str, ...]] = {}

    def clear(self) -> None:
        self.commands.clear()
        self.owner.clear()

    def add(self, ids: tuple[str, ...]) -> None:
        self.commands[ids] = set(ids)
        self.owner.update(dict.fromkeys(ids, ids))

    def answer(self, request_id: str) -> tuple[str, ...] | None:
        """Mark ``request_id`` answered; the ids of its command if that command is now done."""
        ids = self.owner.pop(request_id, None)
        if ids is None:
            return None
        waiting = self.commands[ids]
        waiting.discard(request_id)
        if waiting:
            return None
        del self.commands[ids]
        return ids


def serve_stream(backend: StreamingBackend, conn, version: int, receivers: dict) -> None:
    """Serve commands from ``conn`` until Stop or EOF, stepping ``backend`` while it has work."""
    open_, deferred = _Open(), deque()
    while True:
        try:
            commands = _read(conn, block=not backend.has_unfinished() and not deferred)
        except EOFError:  # the parent is gone
            return
        for command in commands:
            if isinstance(command, Stop):
                return
            if isinstance(command, Generate):
                _submit(backend, conn, command, version, open_)
            elif isinstance(command, Abort):
                _abort(backend, conn, command, open_)
            elif _loads_now(backend, command):
                version = _load_in_flight(backend, conn, command, version, receivers)
            else:
                deferred.append(command)
        if backend.has_unfinished():
            _step(backend, conn, open_)
        while deferred and not backend.has_unfinished():
            version = handle_command(backend, conn, deferred.popleft(), version, receivers)


def _loads_now(backend: StreamingBackend, command: object) -> bool:
    """A Receive with requests running and in-flight updates on (``rollout.in_flight``)."""
    on = getattr(backend, "in_flight_staleness", None) is not None
    return on and isinstance(command, Receive) and backend.has_unfinished()


def _load_in_flight(backend, conn, command: Receive, version: int, receivers: dict) -> int:
    """Pause the running requests, load ``command``, resume them (``rollout.in_flight``)."""
    from megatron_rl.rollout.in_flight import load_between_steps
    from megatron_rl.rollout.worker import receive_load

    return load_between_steps(backend, conn, command, version, lambda b, load: receive_load(b, load, receivers))


def _read(conn, *, block: bool) -> list:
    """Every command waiting on ``conn`` (at least one when ``block``)."""
    commands = [conn.recv()] if block else []
    while conn.poll():
        commands.append(conn.recv())
    return commands


def _submit(backend: StreamingBackend, conn, command: Generate, version: int, open_: _Open) -> None:
    ids = tuple(r.request_id for r in command.requests)
    try:
        backend.submit(command.requests, version)
    except Exception:
        conn.send(Failed(ids, traceback.format_exc()))
        return
    open_.add(ids)


def _step(backend: StreamingBackend, conn, open_: _Open) -> None:
    """One engine step: send each finished request's Result, then its command's Done if complete."""
    try:
        finished = backend.step()
    except Exception:
        _fail_all(backend, conn, open_, traceback.format_exc())
        return
    _answer(conn, finished, open_)


def _fail_all(backend: StreamingBackend, conn, open_: _Open, error: str) -> None:
    """An engine error: drop every request, one Failed per open command."""
    backend.abort_all()
    for ids in list(open_.commands):
        conn.send(Failed(ids, error))
    open_.clear()


def _answer(conn, results: list[GenerationResult], open_: _Open) -> None:
    """Send each result, then its command's Done if it was that command's last request."""
    for result in results:
        conn.send(Result(result))
        ids = open_.answer(result.request_id)
        if ids is not None:
            conn.send(Done(ids))


def _abort(backend: StreamingBackend, conn, command: Abort, open_: _Open) -> None:
    """Abort those of ``command``'s requests still open; answer each (module doc)."""
    open_ids = {rid for rid in command.request_ids if rid in open_.owner}
    if not open_ids:
        return
    try:
        results = backend.abort(open_ids)
    except Exception:
        _fail_all(backend, conn, open_, traceback.format_exc())
        return
    _answer(conn, results, open_)
