"""Collectives over megatron's TP group used by weight export and sync."""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_tp(shard: torch.Tensor) -> list[torch.Tensor]:
    """All-gather ``shard`` over the tensor-parallel group; list in TP-rank order."""
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return [shard]
    out = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(out, shard.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return out
