"""Rank 0 -> the leaders of the other data-parallel replicas: the replica calls, in order.

At DP > 1 the loop runs on global rank 0 only (the one dispatcher: ``pipeline.dispatch`` says
why). Each call it makes goes to its own replica (``replica.ReplicaChannel``) and, through a
``DispatchChannel``, to the leader of every other replica, which relays it to its own ranks
(``replica.follow``); a micro-batch goes to the one replica ``MicroBatch.replica`` names.

Sends are asynchronous (``isend`` on a gloo group of the replica leaders, whatever the
training backend: these are small pickled control messages on the CPU), so rank 0 hands a
micro-batch to replica 1 and goes on training its own while replica 1 trains; per receiver,
messages arrive in the order sent (one gloo pair, one tag per part). Collective calls
(optimizer step, weight sync, save, stop poll) are sent to every replica, so a replica that
got no micro-batch in a mini-batch still joins the gradient all-reduce, with zero gradients.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.parallel.world_timeout import current_group_timeout

_SIZE_TAG, _PAYLOAD_TAG = 71, 72


def replica_leaders() -> list[int]:
    """Global rank of each DP replica's leader (``parallel.state.replica_src_rank``), by DP rank.
    Collective over the world."""
    from megatron.core import parallel_state as ps

    from megatron_rl.parallel.state import replica_src_rank

    mine = (ps.get_data_parallel_rank(), replica_src_rank())  # a replica is TP x PP x CP ranks
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [src for _, src in sorted(set(everyone))]


class DispatchChannel:
    """Ordered asynchronous messages from rank 0 to the other replicas' leaders."""

    def __init__(self) -> None:
        """Collective over the world (every rank must build it, in the same order)."""
        self.leaders = replica_leaders()
        if self.leaders[0] != 0:
            raise RuntimeError(f"the leader of DP replica 0 must be global rank 0, got {self.leaders[0]}")
        self.group = dist.new_group(ranks=self.leaders, backend="gloo", timeout=current_group_timeout())
        self._pending: list[tuple[Any, torch.Tensor]] = []  # (work, buffer kept alive until sent)
        self._lock = threading.Lock()  # rank 0's dispatcher thread and training thread both send

    @property
    def replicas(self) -> int:
        return len(self.leaders)

    def send(self, replica: int, message: tuple[str, Any]) -> None:
        """Queue ``message`` for replica ``replica`` (>= 1); returns without waiting."""
        if not 1 <= replica < self.replicas:
            raise ValueError(f"no remote replica {replica} (data-parallel size {self.replicas})")
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        dst = self.leaders[replica]
        with self._lock:  # a message's two parts stay together
            self._pending.append((dist.isend(size, dst, group=self.group, tag=_SIZE_TAG), size))
            self._pending.append((dist.isend(payload, dst, group=self.group, tag=_PAYLOAD_TAG), payload))
            self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def send_all(self, message: tuple[str, Any]) -> None:
        """``send`` to every remote replica."""
        for replica in range(1, self.replicas):
            self.send(replica, message)

    def flush(self) -> None:
        """Wait until every queued message was delivered."""
        with self._lock:
            pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    def recv(self) -> tuple[str, Any]:
        """On a remote replica's leader: the next message from rank 0 (blocking)."""
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=0, group=self.group, tag=_SIZE_TAG)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(payload, src=0, group=self.group, tag=_PAYLOAD_TAG)
        return pickle.loads(payload.numpy().tobytes())  # noqa: S301 -- from rank 0 of this run
