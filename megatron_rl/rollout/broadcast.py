"""Weight sync by collective broadcast: the trainer's leader (rank 0) sends every HF-named
tensor to the engine workers (ranks 1..n) over a process group of their own.

The group is standalone (a TCPStore rendezvous plus a backend process group), so it never
touches the trainer's torch.distributed world: gloo on CPU, NCCL on CUDA, HCCL on Ascend.
Tensors go one by one in a fixed order announced beforehand (``TensorSpec``), so no rank
holds more than the tensor in flight besides its model. This is the device path of DESIGN
§5; the snapshot path (``update_weights(snapshot_dir)``) needs no group at all.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

GROUP_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class GroupAddress:
    """Where and how the members of one sync group meet (rank 0 hosts the store)."""

    host: str
    port: int
    world_size: int
    backend: str  # "gloo" | "nccl" | "hccl"
    timeout_s: float = 300.0


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one broadcast tensor, announced before the data."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "torch.float32"

    @staticmethod
    def of(name: str, tensor: torch.Tensor) -> TensorSpec:
        return TensorSpec(name, tuple(tensor.shape), str(tensor.dtype))


def make_group(address: GroupAddress, rank: int):
    """Join the sync group at ``address`` as ``rank`` (blocks until every member has joined)."""
    timeout = datetime.timedelta(seconds=address.timeout_s)
    store = dist.TCPStore(address.host, address.port, address.world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore("megatron_rl/weights", store)
    if address.backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, address.world_size, timeout)
    if address.backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, address.world_size)
    if address.backend == "hccl":
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # registered by torch_npu

        return ProcessGroupHCCL(store, rank, address.world_size)
    raise ValueError(f"sync group backend {address.backend!r}: expected one of {sorted(GROUP_BACKENDS.values())}")


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def send_tensors(group, tensors: Iterable[torch.Tensor]) -> None:
    """Rank 0: broadcast ``tensors`` in order (the receivers know their specs)."""
    for tensor in tensors:
        _broadcast(group, tensor.contiguous())


def receive_tensors(group, specs: Sequence[TensorSpec], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks > 0: yield ``(name, tensor)`` for each spec as its broadcast arrives."""
    for spec in specs:
        tensor = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype.removeprefix("torch.")), device=device)
        _broadcast(group, tensor)
        yield spec.name, tensor
