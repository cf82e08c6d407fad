"""Process supervision of engine workers: start, watch, detect death or silence, restart.

Contract:
- ``Supervisor`` owns one ``WorkerHandle`` per ``WorkerSpec``. A new process starts from the
  supervisor's current ``start_load`` / ``version`` (the weights every worker runs: a
  ``weight_sync.WorkerLoad`` loaded before ``Ready``, or None for ``model_path``) and must
  answer ``Ready`` within ``start_timeout_s``.
- ``next_events(workers)`` blocks at most until the earliest deadline of ``workers``: every
  message is yielded as ``(worker, message)``; a worker found dead is yielded once as
  ``(worker, None)``. A worker with commands outstanding that has sent nothing for
  ``request_timeout_s`` is *hung*: it is killed and yielded as dead, so callers need one
  code path for crashes and hangs. ``WorkerHandle.failure`` says which it was.
- ``count_death`` raises ``RolloutWorkerError`` once more than ``max_restarts`` deaths
  happened within one engine call (its callers count per call).
- Commands are pickled in the caller's thread and written by one sender thread per worker,
  so a worker that stops reading its pipe (hung, or busy with a long chunk while a large
  prompt batch waits) never blocks the parent. A write that fails (the worker died) is
  recorded on the handle; the worker's death is then reported by its sentinel.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler

from megatron_rl.rollout.types import GenerationRequest
from megatron_rl.rollout.worker import Failed, Ready, Stop, WorkerSpec, worker_main

STOP_GRACE_S = 10.0  # a stopped worker that has not exited by then is killed


class RolloutWorkerError(RuntimeError):
    """A worker failed: an exception in its backend, a failed start, a hang, or too many deaths."""


@dataclass(frozen=True, kw_only=True)
class WorkerStatus:
    """What the pool knows about one worker (for logs, tests and supervision)."""

    index: int
    pid: int | None
    alive: bool
    device: str
    in_flight: tuple[str, ...]  # request ids sent to it and not yet answered
    restarts: int  # times it was restarted after dying or hanging
    reissued: int  # requests taken back from it when it died and sent again


class _Sender:
    """One daemon thread writing pre-pickled commands to one worker's pipe, in order."""

    _CLOSE = object()

    def __init__(self, conn, name: str):
        self._conn, self._queue = conn, queue.SimpleQueue()
        self.error: OSError | None = None  # the failed write, if any (the worker is gone)
        self._thread = threading.Thread(target=self._run, name=f"{name}-sender", daemon=True)
        self._thread.start()

    def send(self, command: object) -> None:
        self._queue.put(bytes(ForkingPickler.dumps(command)))

    def close(self) -> None:
        """Stop after the queued commands; returns once the thread is done with the pipe (a
        dead worker's pipe fails every write at once), so the pipe may then be closed."""
        self._queue.put(self._CLOSE)
        self._thread.join(STOP_GRACE_S)

    def _run(self) -> None:
        while (data := self._queue.get()) is not self._CLOSE:
            try:
                self._conn.send_bytes(data)
            except OSError as err:  # the worker died or its pipe was closed: its sentinel tells
                self.error = err
                return


@dataclass(eq=False)
class WorkerHandle:
    """One worker process and the commands it has not answered yet."""

    spec: WorkerSpec
    process: mp.process.BaseProcess | None = None
    conn: object = None
    sender: _Sender | None = None
    _outstanding: int = 0  # commands sent and not yet answered (Done / Loaded / Failed): ``outstanding``
    _busy_since: float | None = None  # time.monotonic() when it last went from idle to busy
    _busy_s: float = 0.0  # seconds with commands outstanding, over finished busy spans
    chunks: deque = field(default_factory=deque)  # request ids of each outstanding Generate, in order
    streaming: bool = False  # its Ready said so: chunks join a running batch, Dones come out of order
    in_flight: dict[str, GenerationRequest] = field(default_factory=dict)
    last_heard: float = 0.0  # time.monotonic() of its last message (or of work given while idle)
    failure: str = ""  # how it last died: "exit code N" or "hung ..."
    recv_error: BaseException | None = None  # the last message that could not be read
    restarts: int = 0
    reissued: int = 0

    @property
    def busy(self) -> bool:
        return self.outstanding > 0

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @outstanding.setter
    def outstanding(self, n: int) -> None:
        now = time.monotonic()
        if self._outstanding == 0 and n > 0:
            self._busy_since = now
        elif self._outstanding > 0 and n == 0 and self._busy_since is not None:
            self._busy_s, self._busy_since = self._busy_s + now - self._busy_since, None
        self._outstanding = n

    def busy_seconds(self) -> float:
        """Seconds this worker has had work (generation, weight loads) since the pool started."""
        running = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_s + running

    def reset(self) -> None:
        """Forget every outstanding command (the process died or was drained)."""
        self.outstanding = 0
        self.chunks.clear()
        self.in_flight.clear()

    def pop_chunk(self, request_ids: tuple[str, ...]) -> tuple[str, ...]:
        """Forget the outstanding chunk of ``request_ids`` (a Done / Failed names its command's
        requests; a streaming worker's may come out of order); the oldest one if the message
        names none or an unknown one (a Failed before the command was read). () if none."""
        if request_ids in self.chunks:
            self.chunks.remove(request_ids)
            return request_ids
        return self.chunks.popleft() if self.chunks else ()

    def send(self, command: object) -> None:
        """Queue ``command``; the hang clock starts now if the worker was idle."""
        if self.outstanding == 0:
            self.last_heard = time.monotonic()
        self.outstanding += 1
        self.sender.send(command)

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            index=self.spec.index,
            pid=self.process.pid if self.process else None,
            alive=bool(self.process and self.process.is_alive()),
            device=str(self.spec.device),
            in_flight=tuple(self.in_flight),
            restarts=self.restarts,
            reissued=self.reissued,
        )


class Supervisor:
    """Starts, watches and restarts the worker processes of one pool."""

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        *,
        max_restarts: int,
        start_timeout_s: float,
        request_timeout_s: float,
        remote=None,
        version: int = 0,
    ):
        self._ctx = mp.get_context("spawn")
        self.remote = remote  # rollout.remote.EngineHub: starts the workers of nodes > 0 (spec.node)
        self.workers = [WorkerHandle(spec) for spec in specs]
        self.max_restarts = max_restarts
        self.start_timeout_s = start_timeout_s
        self.request_timeout_s = request_timeout_s
        self.start_load = None  # what a (re)started process loads (weight_sync.WorkerLoad); None: model_path
        self.version = version  # of the weights every worker runs (start_load, or model_path at first)
        self.on_restart: Callable[[WorkerHandle], None] | None = None  # e.g. give it broadcast weights
        self.closed = threading.Event()  # set by stop_all: nothing is (re)started afterwards
        self.gate = None  # rollout.in_flight.UpdateGate with in-flight updates on: who reads the pipes

    def start_all(self) -> None:
        for w in self.workers:
            self._spawn(w)
        for w in self.workers:
            self._await_ready(w)

    def next_events(
        self, workers: list[WorkerHandle], extra: Sequence = ()
    ) -> Iterator[tuple[WorkerHandle, object | None]]:
        """Block until some of ``workers`` (or a waitable of ``extra``: a ``RequestFeed``'s handle)
        has news or the earliest hang deadline; yield (worker, message) per message, then
        (worker, None) once per worker found dead or hung."""
        deadline = {w: w.last_heard + self.request_timeout_s for w in workers if w.busy}
        earliest = min(deadline.values(), default=time.monotonic() + self.request_timeout_s)
        timeout = max(0.0, earliest - time.monotonic())
        handles = {w.conn: w for w in workers} | {w.process.sentinel: w for w in workers}
        ready = dict.fromkeys(handles[h] for h in wait([*handles, *extra], timeout=timeout) if h in handles)
        for w in ready:
            while (message := _try_recv(w)) is not None:
                w.last_heard = time.monotonic()
                yield w, message
            if not w.process.is_alive():
                w.process.join()
                w.failure = f"died with exit code {w.process.exitcode}"
                yield w, None
        now = time.monotonic()
        for w in workers:
            if w not in ready and w in deadline and now >= deadline[w]:
                self._kill_hung(w, now)
                yield w, None

    def _kill_hung(self, w: WorkerHandle, now: float) -> None:
        unsent = f"; a command could not be written to it: {w.sender.error!r}" if w.sender.error else ""
        unsent += f"; a message from it could not be read: {w.recv_error!r}" if w.recv_error else ""
        w.failure = (
            f"hung: no answer for {now - w.last_heard:.1f} s with requests {sorted(w.in_flight)[:8]} "
            f"in flight (rollout.request_timeout_s={self.request_timeout_s}){unsent}"
        )
        w.process.kill()
        w.process.join(STOP_GRACE_S)
        if w.process.is_alive():  # e.g. stuck in an uninterruptible device call
            raise RolloutWorkerError(
                f"rollout worker {w.spec.index} (pid {w.process.pid}) {w.failure}, and "
                f"it did not exit within {STOP_GRACE_S} s of SIGKILL"
            )

    def count_death(self, w: WorkerHandle, deaths: int, during: str) -> int:
        """``deaths + 1``; ``RolloutWorkerError`` once that exceeds ``max_restarts``."""
        deaths += 1
        if deaths > self.max_restarts:
            raise RolloutWorkerError(
                f"rollout workers failed {deaths} times during one {during} call (worker {w.spec.index} "
                f"last: {w.failure}); rollout.max_restarts={self.max_restarts}"
            )
        return deaths

    def revive(self) -> None:
        """Restart every worker whose process is gone (one that died while being drained)."""
        for w in self.workers:
            if not w.process.is_alive():
                w.process.join()
                self.restart(w)

    def restart(self, w: WorkerHandle) -> None:
        """Replace the dead process of ``w`` with a new one running the current version."""
        if self.closed.is_set():  # a generate still running in another thread saw the shutdown's kill
            raise RolloutWorkerError(f"rollout worker {w.spec.index} not restarted: the engine was shut down")
        w.sender.close()
        w.conn.close()
        w.recv_error = None
        w.restarts += 1
        self._spawn(w)
        self._await_ready(w)
        if self.on_restart is not None:
            self.on_restart(w)

    def _spawn(self, w: WorkerHandle) -> None:
        if w.spec.node != 0:  # on its node's engine host, over the network (same protocol)
            w.process, w.conn = self.remote.spawn(w.spec, self.start_load, self.version, self.start_timeout_s)
            w.sender = _Sender(w.conn, w.process.name)
            return
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        w.process = self._ctx.Process(
            target=worker_main,
            args=(w.spec, child_conn, self.start_load, self.version),
            name=f"rollout-worker-{w.spec.index}",
        )
        w.process.start()
        child_conn.close()  # so a dead child shows as EOF on parent_conn
        w.conn, w.sender = parent_conn, _Sender(parent_conn, w.process.name)

    def _await_ready(self, w: WorkerHandle) -> None:
        if not wait([w.conn, w.process.sentinel], timeout=self.start_timeout_s):
            w.process.kill()
            w.process.join(STOP_GRACE_S)
            raise RolloutWorkerError(
                f"rollout worker {w.spec.index} not ready after {self.start_timeout_s} s (rollout.start_timeout_s)"
            )
        message = _try_recv(w)
        if isinstance(message, Ready):
            assert message.version == self.version, (message.version, self.version)
            w.streaming = message.streaming
            return
        if isinstance(message, Failed):
            error = message.error
        else:
            w.process.join(STOP_GRACE_S)
            error = f"the process died with exit code {w.process.exitcode}"
        raise RolloutWorkerError(f"rollout worker {w.spec.index} ({w.spec.device}) failed to start:\n{error}")


def _try_recv(w: WorkerHandle) -> object | None:
    """The next whole message from ``w``, or None if there is none (or only a torn one, kept
    in ``w.recv_error`` for the failure message: the worker is then found dead or hung)."""
    try:
        return w.conn.recv() if w.conn.poll() else None
    except (EOFError, OSError, pickle.UnpicklingError) as err:  # e.g. a torn message from a dying worker
        w.recv_error = err
        return None


def stop_supervised(sup: Supervisor) -> None:
    """Shut ``sup`` down for good: no restart after this (a worker restarted by a generate still
    running in another thread would outlive the pool and block the interpreter's exit), then
    ``stop_workers``."""
    sup.closed.set()
    stop_workers(sup.workers)
    if sup.remote is not None:
        sup.remote.close()
    if sup.gate is not None:  # in-flight updates: the wake-up pipe's two descriptors
        sup.gate.close()


def stop_workers(workers: list[WorkerHandle]) -> None:
    """Ask every worker to stop, wait ``STOP_GRACE_S``, then kill the ones still running."""
    for w in workers:
        if w.process is not None and w.process.is_alive():
            w.sender.send(Stop())
    for w in workers:
        if w.process is not None:
            w.process.join(STOP_GRACE_S)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(STOP_GRACE_S)
        if w.sender is not None:
            w.sender.close()
        if w.conn is not None:
            w.conn.close()
