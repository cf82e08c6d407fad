"""Weight sync of a worker pool: HF snapshot reloads, shared-memory loads, the broadcast group.

Contract:
- ``load_snapshot(dir, version)`` makes every worker load ``dir``; a process started later
  (restart) loads it at start, so the directory must stay readable until the next update.
- ``load_shared(layouts, version)`` makes every worker copy the tensors of the senders'
  shared-memory files (``shared_weights``); a restarted worker loads them again (the files
  hold the version until the next sync, at any PP).
- ``push_tensors(named_tensors, version, peers)`` broadcasts HF-named tensors from this
  process to every worker over a gloo / NCCL / HCCL group (``broadcast``), in flat buckets of
  ``rollout.sync_bucket_mb``, kept while its members live. At PP > 1 ``peers`` are the other
  stages' senders: each has a group of its own with the same workers and sends its stage's
  tensors at the same time, so no rank holds the whole model. This process's tensors are
  cached (its stage), so at PP = 1 a restarted worker is given them through a group of its
  own; after a push with peers a restart between syncs is an error (the peers are busy
  training). A member that dies or hangs during a push is restarted and the push (with
  every peer) repeated, at most ``max_restarts`` times.
- Both return once every worker answered ``Loaded`` for ``version``. Every wait is bounded:
  a silent worker by ``request_timeout_s`` (``Supervisor``), the group rendezvous and each
  broadcast by the same timeout.
- A failure that leaves workers on different weights (a worker's exception, or a collective
  that failed in this process while every worker stayed alive) raises ``RolloutWorkerError``
  with the cause chained, and sets ``broken``: the pool refuses further calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

from megatron_rl.rollout.broadcast import GroupAddress, make_group, open_listener, send_tensors
from megatron_rl.rollout.buckets import MB, BufferRing, TensorSpec
from megatron_rl.rollout.dispatch import drain
from megatron_rl.rollout.supervision import RolloutWorkerError, Supervisor, WorkerHandle
from megatron_rl.rollout.worker import Failed, JoinSyncGroup, Loaded, LoadShared, LoadWeights, ReceiveWeights


class StagePeers(Protocol):
    """The senders of the other pipeline stages (one trainer rank each), as the leader drives
    them through the trainer's own process group (``trainer.stage_sync``)."""

    @property
    def sources(self) -> tuple[tuple[TensorSpec, ...], ...]:
        """The specs each remote stage sends, in stage order (after this process's own)."""
        ...

    def join(self, host: str, world_size: int, backend: str, timeout_s: float) -> tuple[GroupAddress, ...]:
        """Have every peer listen on ``host``, open a group of ``world_size`` (itself as rank 0
        + the workers) and start joining it; returns their addresses, in stage order."""
        ...

    def start_send(self, bucket_bytes: int) -> None:
        """Have every peer start broadcasting its buckets of ``bucket_bytes`` on its group."""
        ...

    def finish_send(self) -> str | None:
        """Wait until every peer is done sending; the first peer's error, if any."""
        ...


class WeightSync:
    """Moves new weights into the workers of ``sup`` (see module doc)."""

    def __init__(self, sup: Supervisor, *, group_backend: str, address: str, bucket_mb: int = 256):
        self._sup = sup
        self._bucket_bytes = bucket_mb * MB  # rollout.sync_bucket_mb
        self._send_ring = BufferRing(2)  # two bucket buffers, kept between syncs
        self._peers: StagePeers | None = None  # the other PP stages' senders of the last push
        self._group_backend = group_backend  # gloo / nccl / hccl
        self._address = address  # the interface the group's listeners bind to
        self._cached_tensors: list | None = None  # the last broadcast weights (restarts get them)
        self._shared: tuple | None = None  # the last shared-memory layouts (restarts load them)
        self._group: tuple | None = None  # (worker pids, process group) of the broadcast sync
        self._pushing = False
        self.broken: str | None = None  # set when workers may run different weights
        sup.on_restart = self._after_restart

    def load_snapshot(self, snapshot_dir: str, version: int) -> None:
        self._sup.snapshot, self._sup.version = snapshot_dir, version  # restarts from here load it
        self._cached_tensors, self._shared = None, None
        self._run_command({w: LoadWeights(snapshot_dir, version) for w in self._sup.workers}, f"load {snapshot_dir}")

    def load_shared(self, layouts: tuple, version: int) -> None:
        self._sup.snapshot, self._sup.version = None, version
        self._cached_tensors, self._shared = None, tuple(layouts)
        self._run_command({w: LoadShared(version, self._shared) for w in self._sup.workers}, "load shared weights")

    def push_tensors(self, named_tensors: Iterable, version: int, peers: StagePeers | None = None) -> None:
        self._sup.snapshot, self._sup.version = None, version
        self._shared = None
        self._cached_tensors = [(name, t.detach()) for name, t in named_tensors]
        self._peers = peers if peers is not None and peers.sources else None
        self._push(self._sup.workers)

    def _after_restart(self, w: WorkerHandle) -> None:
        if self._shared is not None:  # the files hold the current version until the next sync
            self._run_command({w: LoadShared(self._sup.version, self._shared)}, "load shared weights")
            return
        if self._cached_tensors is None or self._pushing:
            return
        self._group = None  # the new process started from model_path; the main group lost a member
        if self._peers is not None:
            stages = len(self._peers.sources) + 1
            self._fail(f"rollout worker {w.spec.index} restarted after a weight sync from {stages} "
                       "pipeline stages: only the next sync can give it the weights (rollout.weight_sync=broadcast "
                       "at parallel.pp > 1 does not survive a worker restart between syncs; use 'snapshot')", None)
        self._push([w], main_group=False)

    def _push(self, workers: list[WorkerHandle], *, main_group: bool = True) -> None:
        """Broadcast the cached tensors (and the peers' stages) to ``workers``; repeated while
        members die."""
        self._pushing = True
        try:
            for _ in range(self._sup.max_restarts + 1):
                if not self._push_once(workers, main_group):
                    return
                self._group = None  # a member died: that group is gone
            raise RolloutWorkerError(
                f"rollout workers kept failing during weight sync (version {self._sup.version}); "
                f"rollout.max_restarts={self._sup.max_restarts}"
            )
        finally:
            self._pushing = False

    def _push_once(self, workers: list[WorkerHandle], main_group: bool) -> list[WorkerHandle]:
        pids = tuple(w.process.pid for w in workers)
        group = self._group[1] if main_group and self._group and self._group[0] == pids else None
        peers = self._peers if main_group else None
        if group is None:
            group, restarted = self._join(workers, peers)
            if restarted:
                return restarted
            if main_group:
                self._group = (pids, group)
        specs = tuple(TensorSpec.of(n, t) for n, t in self._cached_tensors)
        sources = (specs, *(peers.sources if peers else ()))
        tensors = [t for _, t in self._cached_tensors]

        def collective() -> None:
            if peers is not None:
                peers.start_send(self._bucket_bytes)
            try:
                send_tensors(group, tensors, self._bucket_bytes, self._send_ring)
            finally:
                peer_error = peers.finish_send() if peers is not None else None
            if peer_error is not None:
                raise RuntimeError(f"a pipeline stage's sender failed: {peer_error}")

        return self._run_command(
            {w: ReceiveWeights(self._sup.version, sources, self._bucket_bytes) for w in workers}, "receive weights",
            collective=collective,
        )

    def _join(self, workers: list[WorkerHandle], peers: StagePeers | None) -> tuple[object, list[WorkerHandle]]:
        """New groups: this process (rank 0) and ``workers``, and each peer stage's sender with
        the same workers; returns (this process's group, workers restarted)."""
        listener = open_listener(self._address)
        try:
            world, timeout = len(workers) + 1, self._sup.request_timeout_s
            address = GroupAddress(self._address, listener.getsockname()[1], world, self._group_backend,
                                   timeout_s=timeout)
            addresses = (address, *(peers.join(self._address, world, self._group_backend, timeout) if peers else ()))
            holder: list = []
            restarted = self._run_command(
                {w: JoinSyncGroup(addresses, i + 1) for i, w in enumerate(workers)}, "join the sync group",
                collective=lambda: holder.append(make_group(address, 0, listener=listener)),
            )
        finally:
            listener.close()  # a no-op once the group's store owns it
        return (holder[0] if holder else None), restarted

    def _run_command(self, commands: dict, what: str, collective: Callable[[], None] | None = None):
        """Send each worker its command, run this process's side of ``collective``, then wait
        until every worker has answered or failed. Dead or hung workers are restarted and
        returned. The verdict waits for every worker: in a collective, a worker's error is
        often a peer's hang, which only its deadline reveals (the push is then repeated)."""
        for w, command in commands.items():
            w.send(command)
        collective_error = _run_collective(collective, commands, self._sup.request_timeout_s)
        deaths, restarted, failed, waiting = 0, [], [], set(commands)
        while waiting:
            for w, message in self._sup.next_events(list(waiting)):
                if message is None:
                    deaths = self._sup.count_death(w, deaths, what)
                    w.reset()
                    waiting.discard(w)
                    self._sup.restart(w)
                    restarted.append(w)
                elif isinstance(message, (Loaded, Failed)):
                    w.outstanding -= 1
                    waiting.discard(w)
                    if isinstance(message, Failed):
                        failed.append(f"rollout worker {w.spec.index} failed to {what}:\n{message.error}")
        if restarted and collective is not None:
            return restarted  # the group lost a member: the caller repeats the push
        if failed:
            self._fail(failed[0], collective_error)
        if collective_error is not None:
            self._fail(f"{what}: the collective failed in the trainer process while every worker "
                       f"answered: {collective_error}", collective_error)
        return restarted

    def _fail(self, message: str, cause: BaseException | None) -> None:
        drain(self._sup)
        self.broken = f"{message.splitlines()[0]} (version {self._sup.version})"
        raise RolloutWorkerError(message) from cause


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
