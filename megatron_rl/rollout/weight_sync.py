"""Weight sync of a worker pool: HF snapshot reloads, and the broadcast group.

Contract:
- ``load_snapshot(dir, version)`` makes every worker load ``dir``; a process started later
  (restart) loads it at start, so the directory must stay readable until the next update.
- ``push_tensors(named_tensors, version)`` broadcasts HF-named tensors from this process to
  every worker over a gloo / NCCL / HCCL group (``broadcast``), kept while its members live.
  The tensors are cached (one model copy), so a restarted worker is given them through a
  group of its own. A member that dies or hangs meanwhile is restarted and the push repeated,
  at most ``max_restarts`` times.
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

from megatron_rl.rollout.broadcast import GroupAddress, TensorSpec, make_group, open_listener, send_tensors
from megatron_rl.rollout.dispatch import drain
from megatron_rl.rollout.supervision import RolloutWorkerError, Supervisor, WorkerHandle
from megatron_rl.rollout.worker import Failed, JoinSyncGroup, Loaded, LoadWeights, ReceiveWeights


class WeightSync:
    """Moves new weights into the workers of ``sup`` (see module doc)."""

    def __init__(self, sup: Supervisor, *, group_backend: str, address: str):
        self._sup = sup
        self._group_backend = group_backend  # gloo / nccl / hccl
        self._address = address  # the interface the group's listeners bind to
        self._cached_tensors: list | None = None  # the last broadcast weights (restarts get them)
        self._group: tuple | None = None  # (worker pids, process group) of the broadcast sync
        self._pushing = False
        self.broken: str | None = None  # set when workers may run different weights
        sup.on_restart = self._after_restart

    def load_snapshot(self, snapshot_dir: str, version: int) -> None:
        self._sup.snapshot, self._sup.version = snapshot_dir, version  # restarts from here load it
        self._cached_tensors = None
        self._run_command({w: LoadWeights(snapshot_dir, version) for w in self._sup.workers}, f"load {snapshot_dir}")

    def push_tensors(self, named_tensors: Iterable, version: int) -> None:
        self._sup.snapshot, self._sup.version = None, version
        self._cached_tensors = [(name, t.detach()) for name, t in named_tensors]
        self._push(self._sup.workers)

    def _after_restart(self, w: WorkerHandle) -> None:
        if self._cached_tensors is not None and not self._pushing:
            # The new process started from model_path; the pool's main group lost a member.
            self._group = None
            self._push([w], main_group=False)

    def _push(self, workers: list[WorkerHandle], *, main_group: bool = True) -> None:
        """Broadcast the cached tensors to ``workers``; repeated while members die."""
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
        if group is None:
            group, restarted = self._join(workers)
            if restarted:
                return restarted
            if main_group:
                self._group = (pids, group)
        specs = tuple(TensorSpec.of(n, t) for n, t in self._cached_tensors)
        return self._run_command(
            {w: ReceiveWeights(self._sup.version, specs) for w in workers}, "receive weights",
            collective=lambda: send_tensors(group, (t for _, t in self._cached_tensors)),
        )

    def _join(self, workers: list[WorkerHandle]) -> tuple[object, list[WorkerHandle]]:
        """A new group of this process (rank 0) and ``workers``; (group, workers restarted)."""
        listener = open_listener(self._address)
        try:
            address = GroupAddress(self._address, listener.getsockname()[1], len(workers) + 1,
                                   self._group_backend, timeout_s=self._sup.request_timeout_s)
            holder: list = []
            restarted = self._run_command(
                {w: JoinSyncGroup(address, i + 1) for i, w in enumerate(workers)}, "join the sync group",
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
