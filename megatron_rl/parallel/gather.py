"""Collectives used by weight export, sync and checkpoints.

Device data moves on megatron's groups (NCCL / HCCL on accelerators, gloo on CPU) as device
tensors. Host-only bookkeeping (a step count, names, barriers) goes through ``host_group``, a
gloo group over the world: the default group of a device run is NCCL / HCCL and refuses host
tensors ("No backend type associated with device type cpu").
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_gather(shard: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    """All-gather ``shard`` over the group ``group()`` of ``size`` ranks (not asked for at size 1)."""
    if size == 1:
        return [shard]
    out = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(out, shard.contiguous(), group=group())
    return out


def _gather_to_first(shard: torch.Tensor, size: int, group) -> list[torch.Tensor] | None:
    """Point-to-point gather of ``shard`` to rank 0 of ``group()`` (``size`` ranks): the shards in
    group-rank order there, None on the others."""
    if size == 1:
        return [shard]
    group = group()
    first, shard = dist.get_global_rank(group, 0), shard.contiguous()
    if dist.get_rank() != first:
        dist.send(shard, dst=first, group=group)
        return None
    out = [shard]
    for r in range(1, size):
        out.append(torch.empty_like(shard))
        dist.recv(out[-1], src=dist.get_global_rank(group, r), group=group)
    return out


def gather_tp(shard: torch.Tensor) -> list[torch.Tensor]:
    """All-gather ``shard`` over the tensor-parallel group; list in TP-rank order."""
    from megatron.core import parallel_state

    return _all_gather(
        shard, parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_group
    )


def gather_tp_to_first(shard: torch.Tensor) -> list[torch.Tensor] | None:
    """Gather ``shard`` over the tensor-parallel group to its rank 0 only: the shards in TP-rank
    order there, None on the other ranks (which hold nothing but their own shard).

    Point-to-point sends: ``dist.gather`` is missing from NCCL before torch 1.11 and from HCCL
    (torch_npu falls back to an all-gather or refuses), send / recv exist everywhere."""
    from megatron.core import parallel_state

    return _gather_to_first(
        shard, parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_group
    )


def host_group():
    """A gloo group over the whole world for host tensors and objects (``parallel.state``)."""
    from megatron_rl.parallel.state import host_world_group

    return host_world_group()


def max_over_world(value: int) -> int:
    """The largest ``value`` of any rank (host all-reduce on ``host_group``)."""
    if dist.get_world_size() == 1:
        return value
    box = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=host_group())
    return int(box.item())


def host_barrier() -> None:
    """Barrier over the world on ``host_group`` (no device work, no device sync)."""
    if dist.get_world_size() > 1:
        dist.barrier(group=host_group())


def gather_experts(shard: torch.Tensor) -> list[torch.Tensor]:
    """All-gather a routed expert's ``shard`` over megatron's expert tensor-and-model-parallel
    group (expert TP x EP); list in group-rank order (expert TP rank fastest)."""
    from megatron.core import parallel_state

    return _all_gather(
        shard,
        parallel_state.get_expert_tensor_and_model_parallel_world_size(),
        parallel_state.get_expert_tensor_and_model_parallel_group,
    )


def gather_experts_to_first(shard: torch.Tensor) -> list[torch.Tensor] | None:
    """``gather_experts`` to the group's rank 0 only (None elsewhere), point to point as
    ``gather_tp_to_first``."""
    from megatron.core import parallel_state

    return _gather_to_first(
        shard,
        parallel_state.get_expert_tensor_and_model_parallel_world_size(),
        parallel_state.get_expert_tensor_and_model_parallel_group,
    )
