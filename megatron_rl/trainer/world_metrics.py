"""Loss and mismatch metrics of the whole training world, identical on every rank.

A mini-batch's ``LossMetrics`` (sums and maxima, ``algorithms.metrics``) exist only on ranks that
compute a loss: the last pipeline stage of each DP replica, where every TP rank holds the same
copy. Each replica's last stage at TP rank 0 therefore contributes once; every rank gathers
those contributions (one small object all-gather on the host gloo group, since the values are
read on the host anyway) and merges them, so sums are world sums, maxima world maxima, and rank
0 logs them whatever stage it holds. The mismatch alarm reads the same merged values, so every
rank takes the same decision.
"""

from __future__ import annotations

import functools
from dataclasses import fields, is_dataclass, replace
from typing import TypeVar

import torch
import torch.distributed as dist

_M = TypeVar("_M")


def counts_loss() -> bool:
    """True on the one rank per DP replica whose loss metrics count (last stage, TP rank 0, CP
    rank 0: every CP rank computes the same loss from the gathered log-probs)."""
    from megatron.core import parallel_state as ps

    return (
        ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    )


def world_merged(local: _M | None, *, counts: bool) -> _M | None:
    """``local`` (``LossMetrics`` or ``MismatchMetrics``: sums and maxima with a ``merge``) merged
    over every counting rank of the world, None when no rank has any; collective over the world.
    Values come back as host 0-dim tensors."""
    mine = to_host(local) if counts and local is not None else None
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    from megatron_rl.parallel.state import host_world_group

    gathered: list[_M | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine, group=host_world_group())
    parts = [m for m in gathered if m is not None]
    return functools.reduce(type(parts[0]).merge, parts) if parts else None


def to_host(metrics: _M) -> _M:
    """A copy of a metrics dataclass whose tensor fields (nested dataclasses included) are host
    tensors, each of its own dtype: the 0-dim ones moved in one device -> host copy per dtype
    (stacked on the device in their own dtype, never widened there: no fp64 on a 910B), each
    longer one in one more."""
    tensors = [t.detach() for t in _tensors(metrics)]
    if not tensors:
        return metrics
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.dim() == 0:
            by_dtype.setdefault(t.dtype, []).append(t)
    moved = {dtype: iter(torch.stack(group).cpu().unbind()) for dtype, group in by_dtype.items()}
    values = iter([next(moved[t.dtype]) if t.dim() == 0 else t.cpu() for t in tensors])
    return _rebuild(metrics, values)


def _tensors(metrics) -> list[torch.Tensor]:
    out = []
    for f in fields(metrics):
        value = getattr(metrics, f.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif is_dataclass(value):
            out.extend(_tensors(value))
    return out


def _rebuild(metrics, values):
    changes = {}
    for f in fields(metrics):
        value = getattr(metrics, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = next(values).to(value.dtype)
        elif is_dataclass(value):
            changes[f.name] = _rebuild(value, values)
    return replace(metrics, **changes)
