"""``rollout.weight_sync: broadcast``: every pipeline stage's sender broadcasts its HF tensors,
in flat buckets of ``rollout.sync_bucket_mb`` (``buckets``), to the engine workers over a
gloo / NCCL / HCCL group of its own (``group``); no rank ever holds more than its stage.

Roles. Each stage's TP rank 0 is its *sender*; the replica's leader (TP 0 of stage 0) owns
the engine and sends stage 0. The leader hands the engine a ``BroadcastUpdate``; the pool
delivers it by calling back into this module's ``Sender`` (``push``): join the groups if
the workers changed, then send while every worker receives. At PP > 1 the leader drives the
other ranks itself, on the replica channel, while they run ``Sender.follow`` (entered from
their own ``sync``) until it says ``done``, so their object collectives line up:

    ("join", (host, world, backend, timeout_s))  then an all-gather of the senders' addresses
    ("send", (bucket_bytes,))                    then an all-gather of the senders' errors
    ("done", ())                                 the sync is over

Groups are kept between syncs (``Sender`` lives as long as the run). A worker that dies or
hangs during a push is restarted and the push (with every stage) repeated, at most
``max_restarts`` times. A worker restarted between syncs: at PP = 1 it is given the leader's
cached tensors through a group of its own; at PP > 1 that is an error (the other stages are
busy training) naming the fix. Buckets are packed where the group reads them
(``group.buffer_device``): host memory for gloo, the device for NCCL / HCCL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from megatron_rl.weight_sync.base import (
    Fanout,
    SenderSetup,
    SyncStats,
    TensorLoader,
    UpdateTensors,
    WeightUpdate,
    WorkerLoad,
    all_gather,
)
from megatron_rl.weight_sync.buckets import BufferRing, TensorSpec, one_copy_thread
from megatron_rl.weight_sync.group import (
    GroupAddress,
    buffer_device,
    make_group,
    open_listener,
    receive_tensors,
    send_tensors,
)


@dataclass(frozen=True)
class JoinGroups(WorkerLoad):
    """Worker: join one group per sender (stage order) as ``rank``."""

    transport: ClassVar[str] = "broadcast"
    loads: ClassVar[bool] = False
    addresses: tuple[GroupAddress, ...]
    rank: int


@dataclass(frozen=True)
class ReceiveBuckets(WorkerLoad):
    """Worker: receive each sender's tensors (``sources``: its specs, join order) and load them
    (``partial``: some of the model's weights, the engine keeps the others; ``base``)."""

    transport: ClassVar[str] = "broadcast"
    sources: tuple[tuple[TensorSpec, ...], ...]
    bucket_bytes: int
    partial: bool = False


class BroadcastUpdate(WeightUpdate):
    """The leader's stage tensors and every stage's specs; delivered by ``sender.push``."""

    transport: ClassVar[str] = "broadcast"

    def __init__(self, sender: Sender, sources: tuple[tuple[TensorSpec, ...], ...], tensors: list[torch.Tensor]):
        self.sender, self.sources, self.tensors = sender, sources, tensors
        self.partial = sender.setup.source.partial

    @property
    def staged(self) -> bool:
        """Sent by several pipeline stages at once."""
        return len(self.sources) > 1

    def deliver(self, fanout: Fanout) -> None:
        self.sender.push(fanout, self, fanout.workers, main=True)

    def at_start(self) -> None:
        return None  # a new process starts from model_path; after_restart gives it the weights

    def after_restart(self, fanout: Fanout, worker) -> None:
        self.sender.forget_group()  # the main group lost a member
        if self.staged:
            fanout.fail(
                f"rollout worker {worker.spec.index} restarted after a weight sync from {len(self.sources)} "
                "pipeline stages: only the next sync can give it the weights (rollout.weight_sync=broadcast "
                "at parallel.pp > 1 does not survive a worker restart between syncs; use 'snapshot')",
                None,
            )
        self.sender.push(fanout, self, [worker], main=False)


class Sender:
    """Every rank's side: the leader pushes (``push``), the other ranks ``follow``."""

    def __init__(self, setup: SenderSetup):
        self.setup = setup
        self.ring = BufferRing(2)  # send buffers, kept between syncs
        self._main: tuple | None = None  # leader: (worker pids, group) of the last full join
        self._group = None  # a follower stage sender's group
        self._error: str | None = None  # why that group is unusable (reported at the next send)

    def sync(self, version: int) -> SyncStats:
        s = self.setup
        tensors = s.source.export()  # collective over this stage's TP group
        specs = tuple(TensorSpec.of(n, t) for n, t in tensors)
        if s.place.stages == 1:
            if s.engine is not None:
                s.engine.load_weights(BroadcastUpdate(self, (specs,), [t.detach() for _, t in tensors]), version)
            return SyncStats(sum(x.nbytes for x in specs))
        stages = sorted(
            (e for e in all_gather(s.channel, (s.place.stage, specs) if s.place.sender else None) if e is not None),
            key=lambda e: e[0],
        )
        if not s.channel.is_leader:
            self.follow([t for _, t in tensors] if s.place.sender else None)
        else:
            try:
                if s.engine is not None:
                    update = BroadcastUpdate(self, tuple(x for _, x in stages), [t.detach() for _, t in tensors])
                    s.engine.load_weights(update, version)
            finally:
                s.channel.send(("done", ()))
        return SyncStats(sum(x.nbytes for _, stage_specs in stages for x in stage_specs))

    def forget_group(self) -> None:
        self._main = None

    # --- the leader, called by the pool through BroadcastUpdate ---

    def push(self, fanout: Fanout, update: BroadcastUpdate, workers: list, *, main: bool) -> None:
        """Broadcast ``update`` to ``workers`` (``main``: all of them, with every stage; else a
        restarted one, alone, in a group of its own); repeated while members die."""
        for _ in range(fanout.max_restarts + 1):
            if not self._push_once(fanout, update, workers, main):
                return
            self._main = None  # a member died: that group is gone
        fanout.give_up(
            f"rollout workers kept failing during weight sync (version {fanout.version}); "
            f"rollout.max_restarts={fanout.max_restarts}"
        )

    def _push_once(self, fanout: Fanout, update: BroadcastUpdate, workers: list, main: bool) -> list:
        pids = tuple(w.process.pid for w in workers)
        group = self._main[1] if main and self._main and self._main[0] == pids else None
        staged = main and update.staged
        if group is None:
            group, restarted = self._join(fanout, workers, staged)
            if restarted:
                return restarted
            if main:
                self._main = (pids, group)
        sources = update.sources if main else update.sources[:1]
        device = buffer_device(fanout.group_backend, _device_of(update.tensors))

        def collective() -> None:
            if staged:
                self.setup.channel.send(("send", (self.setup.bucket_bytes,)))
            try:
                send_tensors(group, update.tensors, self.setup.bucket_bytes, self.ring, device=device)
            finally:
                peer_error = _first_error(all_gather(self.setup.channel, None)) if staged else None
            if peer_error is not None:
                raise RuntimeError(f"a pipeline stage's sender failed: {peer_error}")

        return fanout.run(
            {w: ReceiveBuckets(sources, self.setup.bucket_bytes, update.partial) for w in workers},
            "receive weights",
            collective=collective,
        )

    def _join(self, fanout: Fanout, workers: list, staged: bool) -> tuple[object, list]:
        """New groups: this process (rank 0) and ``workers``, and (``staged``) each other stage's
        sender with the same workers; returns (this process's group, workers restarted)."""
        listener = open_listener(fanout.address)
        try:
            world = len(workers) + 1
            address = GroupAddress(
                fanout.address, listener.getsockname()[1], world, fanout.group_backend, timeout_s=fanout.timeout_s
            )
            peers = self._peer_addresses(fanout, world) if staged else ()
            holder: list = []
            restarted = fanout.run(
                {w: JoinGroups((address, *peers), i + 1) for i, w in enumerate(workers)},
                "join the sync group",
                collective=lambda: holder.append(make_group(address, 0, listener=listener)),
            )
        finally:
            listener.close()  # a no-op once the group's store owns it
        return (holder[0] if holder else None), restarted

    def _peer_addresses(self, fanout: Fanout, world: int) -> tuple[GroupAddress, ...]:
        channel = self.setup.channel
        channel.send(("join", (fanout.address, world, fanout.group_backend, fanout.timeout_s)))
        return tuple(a for _, a in sorted((e for e in all_gather(channel, None) if e is not None), key=lambda e: e[0]))

    # --- the other ranks of the replica (PP > 1) ---

    def follow(self, tensors: list[torch.Tensor] | None) -> None:
        """Follow the leader's ops until ``done``; ``tensors`` is None on non-sender ranks."""
        channel = self.setup.channel
        while True:
            op, args = channel.recv()
            if op == "done":
                return
            if op == "join":
                self._follower_join(tensors is not None, *args)
            elif op == "send":
                all_gather(channel, self._follower_send(tensors, *args) if tensors is not None else None)
            else:
                raise RuntimeError(f"weight sync: unknown stage-sync op {op!r} from the leader")

    def _follower_join(self, sender: bool, host: str, world: int, backend: str, timeout_s: float) -> None:
        if not sender:
            all_gather(self.setup.channel, None)
            return
        listener = open_listener(host)
        address = GroupAddress(host, listener.getsockname()[1], world, backend, timeout_s=timeout_s)
        all_gather(self.setup.channel, (self.setup.place.stage, address))
        self._group, self._error = None, None
        try:
            self._group = (make_group(address, 0, listener=listener), backend)
        except RuntimeError as err:  # a worker died meanwhile: the leader repeats the join
            self._error = f"stage {self.setup.place.stage}: joining the sync group failed: {err}"
        finally:
            listener.close()

    def _follower_send(self, tensors: list[torch.Tensor], bucket_bytes: int) -> str | None:
        if self._group is None:
            return self._error or "no sync group joined"
        group, backend = self._group
        device = buffer_device(backend, _device_of(tensors))
        try:
            send_tensors(group, tensors, bucket_bytes, self.ring, device=device)
        except RuntimeError as err:  # the leader sees a worker death and repeats the push
            self._group = None
            return f"sending failed: {err}"
        return None


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def _first_error(errors: list) -> str | None:
    return next((e for e in errors if e is not None), None)


class Receiver:
    """Worker side: the joined groups (kept between syncs) and, for a backend that copies each
    tensor before taking the next, two reused receive buffers."""

    def __init__(self) -> None:
        self._groups: list = []
        self._backend = "gloo"
        self._ring: BufferRing | None = None

    def receive(self, load: JoinGroups | ReceiveBuckets, backend: TensorLoader) -> None:
        if isinstance(load, JoinGroups):
            self._groups = [make_group(address, load.rank) for address in load.addresses]
            self._backend = load.addresses[0].backend
            self._ring = BufferRing(2) if getattr(backend, "streams_weights", False) else None
            return
        if len(self._groups) != len(load.sources):
            raise RuntimeError(
                f"ReceiveBuckets from {len(load.sources)} senders, but {len(self._groups)} groups joined"
            )
        device = buffer_device(self._backend, backend.device)
        with one_copy_thread():
            items = (
                item
                for group, specs in zip(self._groups, load.sources, strict=True)
                for item in receive_tensors(group, specs, load.bucket_bytes, device, self._ring)
            )
            backend.load_tensors(UpdateTensors(items, partial=load.partial))
