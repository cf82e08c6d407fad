"""``RequestFeed``: requests handed to an engine while it is already generating (multi-turn).

A single-turn batch knows all its requests up front (``RolloutEngine.generate``). A multi-turn
rollout does not: trajectory i's next turn exists only once its previous turn came back and
its environment answered, while the other trajectories keep decoding. ``generate_stream(feed)``
(``StreamingEngine``; ``WorkerPool`` implements it for every backend) takes requests from a
feed as they are ``put``, dispatches them to any worker with room, and ends once the feed is
``close``d and every request put before was answered.

Contract:
- ``put`` / ``close`` / ``abort`` may be called from any thread; ``put`` after ``close`` raises.
- ``handle`` is a ``multiprocessing.connection.wait``-able object that becomes ready whenever
  something was put or the feed closed, so the dispatcher sleeps on its workers and the feed
  at once (no polling; a new turn never waits for another worker's chunk to finish).
- ``abort`` ends the stream at the dispatcher's next wake-up, answered or not (producer stop).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from multiprocessing import Pipe
from typing import Protocol, runtime_checkable

from megatron_rl.rollout.types import GenerationRequest, GenerationResult


class RequestFeed:
    """A thread-safe, growable queue of ``GenerationRequest``s with a waitable wake-up handle."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[GenerationRequest] = []
        self._closed = self._aborted = False
        self._reader, self._writer = Pipe(duplex=False)
        self.put_count = 0  # requests ever put (the stream answers exactly these)

    @property
    def handle(self):
        """Readable whenever the feed has news (see module doc)."""
        return self._reader

    def put(self, request: GenerationRequest) -> None:
        """Add one request; it is dispatched at the stream's next wake-up."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"RequestFeed: put({request.request_id!r}) after close")
            if not request.prompt_ids:
                raise ValueError(f"requests: request {request.request_id!r} has an empty prompt")
            self._pending.append(request)
            self.put_count += 1
        self._wake()

    def close(self) -> None:
        """No more requests: the stream ends once every request put so far was answered."""
        with self._lock:
            self._closed = True
        self._wake()

    def abort(self) -> None:
        """End the stream at once (unanswered requests are dropped)."""
        with self._lock:
            self._closed = self._aborted = True
        self._wake()

    def take(self) -> tuple[list[GenerationRequest], bool, bool]:
        """(requests put since the last take, closed, aborted); clears the wake-up handle."""
        while self._reader.poll():
            self._reader.recv_bytes()
        with self._lock:
            taken, self._pending = self._pending, []
            return taken, self._closed, self._aborted

    def _wake(self) -> None:
        try:
            self._writer.send_bytes(b"")
        except OSError:  # the stream is gone (closed pipe): nothing left to wake
            pass


@runtime_checkable
class StreamingEngine(Protocol):
    """An engine that can take requests while generating (``WorkerPool``; wrappers forward it)."""

    def generate_stream(self, feed: RequestFeed) -> Iterator[GenerationResult]:
        """Yield one result per request put on ``feed``, in completion order, until it is closed
        and drained (or aborted). Holds the engine like ``generate``: no weight load meanwhile,
        so every result of one stream carries the same weight version."""
        ...
