"""Sync groups: one sender (a trainer rank holding HF-named tensors) broadcasts them, packed
into flat buckets (``buckets``), to the engine workers over a process group of their own
(the transport ``broadcast`` builds on it).

The group is standalone (a TCPStore rendezvous plus a backend process group), so it never
touches the trainer's torch.distributed world: gloo on CPU, NCCL on CUDA, HCCL on Ascend.
The sender is the group's rank 0; the workers are ranks 1..n. At PP > 1 every pipeline stage
has a sender and a group of its own with the same workers. Tensors go in the bucket order
both sides derive from the announced ``TensorSpec`` list, so a rank holds at most two buckets
in flight besides its model. Buckets live where the group's backend reads them
(``buffer_device``): host memory for gloo (device tensors are packed into a host buffer),
the tensors' device for NCCL / HCCL.

Listeners bind to ``GroupAddress.host`` only (``rollout.sync_address``, loopback by default):
the sender binds the store's socket itself (``open_listener``; TCPStore alone would listen on
every interface) and gloo's pair sockets are bound to the same address. NCCL / HCCL open their
own bootstrap sockets: restrict them with ``NCCL_SOCKET_IFNAME`` / ``HCCL_IF_IP``. Every wait
is bounded by ``GroupAddress.timeout_s``.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.weight_sync.buckets import BufferRing, TensorSpec, Unpacker, one_copy_thread, pack, plan_buckets

__all__ = [
    "GROUP_BACKENDS",
    "GroupAddress",
    "TensorSpec",
    "buffer_device",
    "make_group",
    "open_listener",
    "receive_tensors",
    "send_tensors",
]

GROUP_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class GroupAddress:
    """Where and how the members of one sync group meet (rank 0 hosts the store)."""

    host: str
    port: int
    world_size: int
    backend: str  # "gloo" | "nccl" | "hccl"
    timeout_s: float = 300.0


def open_listener(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` and a free port, for rank 0's store (``make_group``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, 0))
        sock.listen()
    except OSError as err:
        sock.close()
        raise ValueError(
            f"rollout.sync_address={host!r}: cannot listen there ({err}); "
            "give an address of this machine, e.g. 127.0.0.1"
        ) from err
    return sock


def make_group(address: GroupAddress, rank: int, *, listener: socket.socket | None = None):
    """Join the sync group at ``address`` as ``rank`` (blocks until every member has joined,
    at most ``address.timeout_s``). Rank 0 passes the socket of ``open_listener``: the store
    then owns it."""
    timeout = datetime.timedelta(seconds=address.timeout_s)
    if rank == 0 and listener is None:
        raise ValueError("make_group: rank 0 needs the listener socket of open_listener(address.host)")
    store = dist.TCPStore(
        address.host,
        address.port,
        address.world_size,
        is_master=rank == 0,
        timeout=timeout,
        master_listen_fd=listener.detach() if rank == 0 else None,
    )
    store = dist.PrefixStore("megatron_rl/weights", store)
    if address.backend == "gloo":  # options as torch's own new_group builds them: a device on host
        options = dist.ProcessGroupGloo._Options()
        # a worker on another node binds its pair sockets to its own address (megatron_rl serve --address: cli.serve)
        host = address.host if rank == 0 else os.environ.get("MEGATRON_RL_NODE_ADDR", address.host)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, address.world_size, options)
    if address.backend == "nccl":  # the watchdog aborts a collective stuck past the timeout
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, address.world_size, options)
    if address.backend == "hccl":
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # registered by torch_npu

        return ProcessGroupHCCL(store, rank, address.world_size)
    raise ValueError(f"sync group backend {address.backend!r}: expected one of {sorted(GROUP_BACKENDS.values())}")


def buffer_device(backend: str, like: torch.device) -> torch.device:
    """Where the buckets of a ``backend`` group live: gloo reads host memory only; NCCL / HCCL
    read the device (``like``: the device of the tensors sent, or of the receiving model)."""
    return torch.device("cpu") if backend == "gloo" else like


def _broadcast(group, tensor: torch.Tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)  # .wait() is bounded by the group's timeout (make_group)


def send_tensors(
    group,
    tensors: Sequence[torch.Tensor],
    bucket_bytes: int,
    ring: BufferRing | None = None,
    *,
    device: torch.device | None = None,
) -> int:
    """Rank 0: broadcast ``tensors`` (in the order of the specs the receivers were given) in
    buckets of ``bucket_bytes``, packed into the two buffers of ``ring`` (kept by the caller
    between syncs, or new) on ``device`` (``buffer_device``; default: the tensors' own); the
    next bucket is packed while the last one is in flight. Returns the bytes sent."""
    specs = [TensorSpec.of(str(i), t) for i, t in enumerate(tensors)]
    ring = ring if ring is not None else BufferRing(2)
    in_flight, sent = None, 0
    for k, bucket in enumerate(plan_buckets(specs, bucket_bytes)):
        where = device if device is not None else tensors[bucket.pieces[0].index].device
        with one_copy_thread():
            buffer = pack(bucket, tensors, out=ring.get(k, bucket, where))
        if in_flight is not None:
            in_flight.wait()
        in_flight, sent = _broadcast(group, buffer), sent + bucket.nbytes
    if in_flight is not None:
        in_flight.wait()
    return sent


def receive_tensors(
    group, specs: Sequence[TensorSpec], bucket_bytes: int, device: torch.device, ring: BufferRing | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks > 0: yield ``(name, tensor)`` for every spec as its bucket arrives; the next
    bucket is received while this one's tensors are consumed. Without ``ring`` every bucket
    gets a fresh buffer (the yielded views stay valid to the end); with one (a consumer that
    copies each tensor before asking for the next) two buffers are reused."""
    unpacker, buckets = Unpacker(specs), plan_buckets(specs, bucket_bytes)

    def post(k: int):
        bucket = buckets[k]
        buffer = (
            ring.get(k, bucket, device)
            if ring is not None
            else torch.empty(bucket.numel, dtype=bucket.torch_dtype, device=device)
        )
        return buffer, _broadcast(group, buffer)

    pending = post(0) if buckets else None
    for k, bucket in enumerate(buckets):
        buffer, work = pending
        work.wait()
        pending = post(k + 1) if k + 1 < len(buckets) else None
        yield from unpacker.feed(bucket, buffer)
