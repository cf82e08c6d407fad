"""A supervised pool of engine worker processes: the ``RolloutEngine`` every backend shares.

Contract:
- ``generate`` splits the requests into chunks (at most ``max_batch_size``, spread over the
  workers), gives each idle worker one chunk at a time and yields results as they arrive.
- A worker that dies (killed, crashed, OOM) is restarted with the current weight snapshot
  and version, and its unanswered requests are re-issued. Results are keyed by request id,
  so every request is answered exactly once. More than ``max_restarts`` deaths within one
  call raise ``RolloutWorkerError``.
- A Python exception inside a worker is not a death: it is raised in the caller as
  ``RolloutWorkerError`` naming the worker and its requests.
- ``update_weights`` returns once every worker runs the new version; results always carry
  the version they were sampled with. Restarted workers load the latest snapshot, so the
  snapshot directory must stay readable until the next update.
- Not detected: a worker that hangs while alive (no per-request timeout yet).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import pickle
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

from megatron_rl.rollout.types import GenerationRequest, GenerationResult
from megatron_rl.rollout.worker import (
    Done,
    Failed,
    Generate,
    JoinSyncGroup,
    Loaded,
    LoadWeights,
    Ready,
    ReceiveWeights,
    Result,
    Stop,
    WorkerSpec,
    worker_main,
)

_STOP_GRACE_S = 10.0


class RolloutWorkerError(RuntimeError):
    """A worker failed: an exception in its backend, a failed start, or too many deaths."""


@dataclass(frozen=True, kw_only=True)
class WorkerStatus:
    """What the pool knows about one worker (for logs, tests and supervision)."""

    index: int
    pid: int | None
    alive: bool
    device: str
    in_flight: tuple[str, ...]  # request ids sent to it and not yet answered
    restarts: int  # times it was restarted after dying
    reissued: int  # requests taken back from it when it died and sent again


@dataclass(eq=False)
class _Worker:
    spec: WorkerSpec
    process: mp.process.BaseProcess | None = None
    conn: object = None
    outstanding: int = 0  # commands sent and not yet answered (Done / Loaded / Failed)
    chunks: deque = field(default_factory=deque)  # request ids of each outstanding Generate, in order
    in_flight: dict[str, GenerationRequest] = field(default_factory=dict)
    restarts: int = 0
    reissued: int = 0

    @property
    def busy(self) -> bool:
        return self.outstanding > 0

    def reset(self) -> None:
        """Forget every outstanding command (the process died or was drained)."""
        self.outstanding = 0
        self.chunks.clear()
        self.in_flight.clear()


# Generate commands queued per worker: while it decodes one chunk the next is already in its
# pipe, so it never idles waiting for the parent (whose producer thread shares a core and the
# GIL with training) to hand out more work.
_PREFETCH = 2


class WorkerPool:
    """``RolloutEngine`` over worker processes built from ``specs`` (one process per spec)."""

    def __init__(
        self, specs: Sequence[WorkerSpec], *, max_batch_size: int, max_restarts: int = 3,
        start_timeout_s: float = 600.0, sync_backend: str = "gloo",
    ):
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(spec) for spec in specs]
        self._max_batch_size = max_batch_size
        self._max_restarts = max_restarts
        self._start_timeout_s = start_timeout_s
        self._snapshot: str | None = None
        # generate() and update_weights() may come from different threads (stale mode: the
        # producer generates batch t+1 while the trainer syncs version t+1): a weight update
        # waits for the generate call in progress, so every batch runs on one version.
        self._lock = threading.RLock()
        self._sync_backend = sync_backend  # broadcast weight sync: gloo / nccl / hccl
        self._cached_tensors: list | None = None  # the last broadcast weights (restarts get them)
        self._group: tuple | None = None  # (worker pids, process group) of the broadcast sync
        self._pushing = False
        self._version = 0
        self._active: int | None = None  # thread id of the generate() iteration in progress
        self._broken: str | None = None  # set when workers may run different weights
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        try:
            for w in self._workers:
                self._spawn(w)
            for w in self._workers:
                self._await_ready(w)
        except BaseException:
            self.shutdown()
            raise

    @property
    def weight_version(self) -> int:
        """The version every worker currently runs (0: the weights at ``model_path``)."""
        return self._version

    def status(self) -> tuple[WorkerStatus, ...]:
        """One ``WorkerStatus`` per worker, in index order."""
        return tuple(
            WorkerStatus(
                index=w.spec.index, pid=w.process.pid if w.process else None,
                alive=bool(w.process and w.process.is_alive()), device=str(w.spec.device),
                in_flight=tuple(w.in_flight), restarts=w.restarts, reissued=w.reissued,
            )
            for w in self._workers
        )

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

    def update_weights(self, snapshot_dir: str, version: int) -> None:
        """Load the HF safetensors in ``snapshot_dir`` into every worker as ``version``."""
        if not Path(snapshot_dir).is_dir():
            raise ValueError(f"snapshot_dir={snapshot_dir!r} is not a directory")
        if version <= self._version:
            raise ValueError(f"version={version} must exceed the current weight_version {self._version}")
        with self._lock:
            self._load(str(snapshot_dir), version)

    def _load(self, snapshot_dir: str, version: int) -> None:
        self._check_idle("update_weights")
        self._snapshot, self._version = snapshot_dir, version  # restarts from here load it
        self._cached_tensors = None
        self._run_command({w: LoadWeights(snapshot_dir, version) for w in self._workers}, f"load {snapshot_dir}")

    def update_weights_from_tensors(self, named_tensors, version: int) -> None:
        """Broadcast HF-named full tensors from this process to every worker (``broadcast``
        module: gloo / NCCL / HCCL group) and load them as ``version``. The tensors are kept
        (one model copy, host or device) so a worker restarted later can be given them."""
        if version <= self._version:
            raise ValueError(f"version={version} must exceed the current weight_version {self._version}")
        with self._lock:
            self._check_idle("update_weights")
            self._snapshot, self._version = None, version
            self._cached_tensors = [(name, t.detach()) for name, t in named_tensors]
            self._push(self._workers)

    def _push(self, workers: list[_Worker], *, main_group: bool = True) -> None:
        """Broadcast the cached tensors to ``workers`` (all of them: through the pool's sync
        group, kept while its members live; one restarted worker: a group of its own).
        Workers that die meanwhile are restarted and the push is repeated."""
        self._pushing = True
        try:
            for _ in range(self._max_restarts + 1):
                if not self._push_once(workers, main_group):
                    return
                self._group = None  # a member died: that group is gone
            raise RolloutWorkerError(f"rollout workers kept dying during weight sync (version {self._version})")
        finally:
            self._pushing = False

    def _push_once(self, workers: list[_Worker], main_group: bool) -> list[_Worker]:
        from megatron_rl.rollout.broadcast import GroupAddress, TensorSpec, make_group, send_tensors

        pids = tuple(w.process.pid for w in workers)
        group = self._group[1] if main_group and self._group and self._group[0] == pids else None
        if group is None:
            address = GroupAddress("127.0.0.1", _free_port(), len(workers) + 1, self._sync_backend)
            holder: list = []
            restarted = self._run_command(
                {w: JoinSyncGroup(address, i + 1) for i, w in enumerate(workers)}, "join the sync group",
                collective=lambda: holder.append(make_group(address, 0)),
            )
            if restarted:
                return restarted
            group = holder[0]
            if main_group:
                self._group = (pids, group)
        specs = tuple(TensorSpec.of(n, t) for n, t in self._cached_tensors)
        return self._run_command({w: ReceiveWeights(self._version, specs) for w in workers}, "receive weights",
                                 collective=lambda: send_tensors(group, (t for _, t in self._cached_tensors)))

    def _run_command(self, commands: dict, what: str, collective=None) -> list[_Worker]:
        """Send each worker its command, run this process's side of a collective (if any),
        then wait until every worker has answered ``Loaded``. Dead workers are restarted and
        returned; a failure marks the pool unusable (its workers may run different weights)."""
        for w, command in commands.items():
            _send(w, command)
        if collective is not None:
            try:
                collective()
            except RuntimeError:  # a member died mid-collective: found (and restarted) below
                pass
        deaths, restarted, waiting = 0, [], set(commands)  # other workers may be mid-generate
        while waiting:
            for w, message in self._next_events(list(waiting)):
                if message is None:
                    deaths = self._count_death(w, deaths, what)
                    w.reset()
                    waiting.discard(w)
                    self._restart(w)
                    restarted.append(w)
                elif isinstance(message, Loaded):
                    w.outstanding -= 1
                    waiting.discard(w)
                elif isinstance(message, Failed):
                    w.outstanding -= 1
                    waiting.discard(w)
                    if restarted:  # a peer's death broke the collective: the push is repeated
                        continue
                    self._drain()
                    self._broken = f"worker {w.spec.index} failed to {what} (version {self._version})"
                    raise RolloutWorkerError(f"rollout worker {w.spec.index} failed to {what}:\n{message.error}")
        return restarted

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
        self._finalizer()

    # ---- generation -------------------------------------------------------------------

    def _generate(self, requests: list[GenerationRequest]) -> Iterator[GenerationResult]:
        with self._lock:
            yield from self._generate_locked(requests)

    def _generate_locked(self, requests: list[GenerationRequest]) -> Iterator[GenerationResult]:
        self._check_idle("generate")
        self._active = threading.get_ident()
        pending = deque(requests)
        answered: set[str] = set()
        chunk = max(1, min(self._max_batch_size, math.ceil(len(requests) / len(self._workers))))
        deaths = 0
        try:
            while len(answered) < len(requests):
                self._dispatch(pending, chunk)
                for w, message in self._next_events([w for w in self._workers if w.busy]):
                    if message is None:
                        deaths = self._count_death(w, deaths, "generate")
                        pending.extendleft(reversed(self._take_back(w)))
                        self._restart(w)
                    elif isinstance(message, Result):
                        result = message.result
                        if w.in_flight.pop(result.request_id, None) and result.request_id not in answered:
                            assert result.weight_version == self._version, (result.weight_version, self._version)
                            answered.add(result.request_id)
                            yield result
                    elif isinstance(message, Done):
                        self._finish_chunk(w)
                    elif isinstance(message, Failed):
                        w.outstanding -= 1
                        failed = w.chunks.popleft() if w.chunks else ()
                        for rid in failed:
                            w.in_flight.pop(rid, None)
                        raise RolloutWorkerError(
                            f"rollout worker {w.spec.index} (pid {w.process.pid}) failed on requests "
                            f"{list(message.request_ids)}:\n{message.error}"
                        )
        finally:
            self._drain()
            self._active = None

    def _dispatch(self, pending: deque, chunk: int) -> None:
        for w in self._workers:
            while pending and w.outstanding < _PREFETCH:
                batch = tuple(pending.popleft() for _ in range(min(chunk, len(pending))))
                w.in_flight.update((r.request_id, r) for r in batch)
                w.chunks.append(tuple(r.request_id for r in batch))
                _send(w, Generate(batch))

    def _finish_chunk(self, w: _Worker) -> None:
        w.outstanding -= 1
        missing = [rid for rid in w.chunks.popleft() if rid in w.in_flight]
        if missing:
            for rid in missing:
                del w.in_flight[rid]
            raise RolloutWorkerError(f"rollout worker {w.spec.index} finished a chunk without answering {missing}")

    def _take_back(self, w: _Worker) -> list[GenerationRequest]:
        lost = list(w.in_flight.values())
        w.reset()
        w.reissued += len(lost)
        return lost

    def _drain(self) -> None:
        """Wait until no worker has a command outstanding, discarding what they still send."""
        while busy := [w for w in self._workers if w.busy]:
            for w, message in self._next_events(busy):
                if message is None:
                    w.reset()
                    self._restart(w)
                elif isinstance(message, (Done, Failed, Loaded)):
                    w.outstanding -= 1
                    if w.chunks and not isinstance(message, Loaded):
                        for rid in w.chunks.popleft():
                            w.in_flight.pop(rid, None)

    # ---- process supervision ----------------------------------------------------------

    def _next_events(self, workers: list[_Worker]) -> Iterator[tuple[_Worker, object | None]]:
        """Block until some of ``workers`` has news; yield (worker, message) for each message,
        then (worker, None) once for a worker found dead (after whatever it sent before dying)."""
        handles = {w.conn: w for w in workers} | {w.process.sentinel: w for w in workers}
        for w in dict.fromkeys(handles[h] for h in wait(list(handles))):
            while (message := _try_recv(w.conn)) is not None:
                yield w, message
            if not w.process.is_alive():
                w.process.join()
                yield w, None

    def _count_death(self, w: _Worker, deaths: int, during: str) -> int:
        deaths += 1
        if deaths > self._max_restarts:
            raise RolloutWorkerError(
                f"rollout workers died {deaths} times during one {during} call (worker {w.spec.index} "
                f"last, exit code {w.process.exitcode}); rollout.max_restarts={self._max_restarts}"
            )
        return deaths

    def _spawn(self, w: _Worker) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        w.process = self._ctx.Process(
            target=worker_main, args=(w.spec, child_conn, self._snapshot, self._version),
            name=f"rollout-worker-{w.spec.index}",
        )
        w.process.start()
        child_conn.close()  # so a dead child shows as EOF on parent_conn
        w.conn = parent_conn

    def _await_ready(self, w: _Worker) -> None:
        if not wait([w.conn, w.process.sentinel], timeout=self._start_timeout_s):
            raise RolloutWorkerError(f"rollout worker {w.spec.index} not ready after {self._start_timeout_s} s")
        message = _try_recv(w.conn)
        if isinstance(message, Ready):
            assert message.version == self._version, (message.version, self._version)
            return
        if isinstance(message, Failed):
            error = message.error
        else:
            w.process.join()
            error = f"the process died with exit code {w.process.exitcode}"
        raise RolloutWorkerError(f"rollout worker {w.spec.index} ({w.spec.device}) failed to start:\n{error}")

    def _restart(self, w: _Worker) -> None:
        w.conn.close()
        w.restarts += 1
        self._spawn(w)
        self._await_ready(w)
        if self._cached_tensors is not None and not self._pushing:
            # Broadcast sync: the new process started from model_path; give it the current
            # weights through a group of its own (the pool's main group lost a member).
            self._group = None
            self._push([w], main_group=False)

    def _check_idle(self, what: str) -> None:
        if not self._finalizer.alive:
            raise RuntimeError(f"{what}: the rollout engine has been shut down")
        if self._broken:
            raise RuntimeError(f"{what}: the rollout engine is unusable ({self._broken}); shut it down")
        # Another thread's generate() is waited for (the lock); this thread's own open iterator
        # would deadlock, so it is an error.
        if self._active == threading.get_ident():
            raise RuntimeError(f"{what}: a generate() iterator of this engine is still open; exhaust or close it")


def _send(w: _Worker, command: object) -> None:
    """Queue ``command`` on ``w``. A worker that died meanwhile is found by its sentinel in the
    next wait, which takes the outstanding requests back."""
    w.outstanding += 1
    try:
        w.conn.send(command)
    except OSError:
        pass


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _try_recv(conn) -> object | None:
    """The next whole message on ``conn``, or None if there is none (or only a torn one)."""
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError, pickle.UnpicklingError):
        return None


def _stop_workers(workers: list[_Worker]) -> None:
    for w in workers:
        if w.process is not None and w.process.is_alive():
            try:
                w.conn.send(Stop())
            except OSError:
                pass
    for w in workers:
        if w.process is not None:
            w.process.join(_STOP_GRACE_S)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
        if w.conn is not None:
            w.conn.close()
