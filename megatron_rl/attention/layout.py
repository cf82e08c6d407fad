"""The attention geometry of one packed micro-batch: which keys each query token may see.

A micro-batch is several groups concatenated with no padding (THD style). A group is
``[prompt, r_1, ..., r_K]``: prompt tokens are causal among themselves; a token of ``r_i``
sees the whole prompt and the earlier tokens of ``r_i``, nothing of ``r_j`` (j != i) and
nothing of another group. A group with K = 0 is a plain causal sequence.

Every query token ``t`` sees exactly the keys ``[group_start[t], prefix_end[t]) ∪
[seg_start[t], t]`` (packed indices): for a prompt token the first interval is empty and
``seg_start`` is the group's start; for a response token the first interval is the prompt
and ``seg_start`` is the response's first token. Every backend derives its mask from these
three ``[T]`` arrays (or from ``groups``), so they are the single definition of the mask.

``AttentionLayout`` is built once per micro-batch on the CPU; backend-specific plans
(gather indices, block lists, NPU arguments) are built on first use for a given device and
cached on the layout, so every layer of the model reuses them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

_PlanT = TypeVar("_PlanT")


@dataclass(frozen=True, kw_only=True)
class GroupSpan:
    """One group's place in the packed micro-batch: ``[prompt, r_1, ..., r_K]`` from ``start``."""

    start: int  # packed index of the prompt's first token
    prompt_len: int
    response_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + sum(self.response_lens)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def response_starts(self) -> tuple[int, ...]:
        """Packed index of each response's first token."""
        offsets = itertools.accumulate(self.response_lens[:-1], initial=self.start + self.prompt_len)
        return tuple(offsets) if self.response_lens else ()


@dataclass(frozen=True, kw_only=True, eq=False)
class AttentionLayout:
    """Mask description of a packed micro-batch of ``total_tokens`` tokens (see module doc).

    ``group_start``, ``prefix_end``, ``seg_start``: ``[T]`` int64 on the CPU.
    ``cu_seqlens``: ``[n_segments + 1]`` int32, boundaries of every prompt and response.
    """

    groups: tuple[GroupSpan, ...]
    total_tokens: int
    group_start: torch.Tensor
    prefix_end: torch.Tensor
    seg_start: torch.Tensor
    cu_seqlens: torch.Tensor
    _plans: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_lengths(cls, prompt_lens: Sequence[int], response_lens: Sequence[Sequence[int]]) -> AttentionLayout:
        """Layout of groups packed back to back: group g is ``prompt_lens[g]`` prompt tokens
        followed by responses of ``response_lens[g]`` tokens each."""
        if len(prompt_lens) != len(response_lens):
            raise ValueError(f"prompt_lens has {len(prompt_lens)} groups but response_lens has {len(response_lens)}")
        groups, start = [], 0
        for g, (lp, lrs) in enumerate(zip(prompt_lens, response_lens, strict=True)):
            if int(lp) < 1:
                raise ValueError(f"prompt_lens[{g}] must be >= 1, got {lp}")
            if any(int(lr) < 1 for lr in lrs):
                raise ValueError(f"response_lens[{g}] must all be >= 1, got {list(lrs)}")
            span = GroupSpan(start=start, prompt_len=int(lp), response_lens=tuple(int(x) for x in lrs))
            groups.append(span)
            start = span.end
        return cls._from_groups(tuple(groups), start)

    @classmethod
    def _from_groups(cls, groups: tuple[GroupSpan, ...], total: int) -> AttentionLayout:
        group_start = torch.empty(total, dtype=torch.int64)
        prefix_end = torch.empty(total, dtype=torch.int64)
        seg_start = torch.empty(total, dtype=torch.int64)
        bounds = [0]
        for span in groups:
            p_end = span.start + span.prompt_len
            group_start[span.start : span.end] = span.start
            prefix_end[span.start : p_end] = span.start  # prompt: empty prefix interval
            seg_start[span.start : p_end] = span.start
            prefix_end[p_end : span.end] = p_end
            bounds.append(p_end)
            for r_start, r_len in zip(span.response_starts, span.response_lens, strict=True):
                seg_start[r_start : r_start + r_len] = r_start
                bounds.append(r_start + r_len)
        cu = torch.tensor(bounds, dtype=torch.int32)
        return cls(
            groups=groups,
            total_tokens=total,
            group_start=group_start,
            prefix_end=prefix_end,
            seg_start=seg_start,
            cu_seqlens=cu,
        )

    @property
    def num_responses(self) -> int:
        return sum(len(g.response_lens) for g in self.groups)

    def dense_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[T, T]`` bool, True where query row may attend key column. O(T^2): tests only."""
        t = torch.arange(self.total_tokens)
        j = t[None, :]
        prefix = (j >= self.group_start[:, None]) & (j < self.prefix_end[:, None])
        own = (j >= self.seg_start[:, None]) & (j <= t[:, None])
        return (prefix | own).to(device)

    def cached_plan(self, key: tuple[Any, ...], build: Callable[[], _PlanT]) -> _PlanT:
        """The plan stored under ``key`` (backend name, device, options), built once on first use."""
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]
