"""Switch a LoRA model's adapters for one forward: off (the frozen base: the reference policy) or
swapped for a snapshot of earlier adapter values (the old policy), without touching parameters.

The switch sets flags the adapter's forward hook reads (``LoraAdapter.off`` / ``.swapped``): no
parameter is written, so a policy forward's autograd graph recorded before the switch stays valid,
and the same module can score the policy, old and reference streams of one micro-batch in turn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_rl.lora.apply import lora_adapters


@dataclass(frozen=True)
class AdapterSnapshot:
    """Detached copies of every adapter tensor of a model, (A, B) per part per adapter in module
    order, on the adapters' device and dtype: the old policy of a LoRA tri-model."""

    tensors: tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], ...]

    @property
    def nbytes(self) -> int:
        """Bytes the snapshot holds."""
        return sum(t.numel() * t.element_size() for adapter in self.tensors for pair in adapter for t in pair)


def snapshot_adapters(model: torch.nn.Module) -> AdapterSnapshot:
    """A new snapshot of ``model``'s adapters as they are now (refused on a model without adapters)."""
    adapters = list(lora_adapters(model))
    if not adapters:
        raise ValueError("the model has no LoRA adapters to snapshot (apply_lora was not run on it)")
    with torch.no_grad():
        return AdapterSnapshot(
            tuple(
                tuple((p.lora_A.detach().clone(), p.lora_B.detach().clone()) for p in a.parts.values())
                for a in adapters
            )
        )


@torch.no_grad()
def refresh_snapshot(snapshot: AdapterSnapshot, model: torch.nn.Module) -> None:
    """Copy ``model``'s current adapter values into ``snapshot`` (in place, same tensors)."""
    adapters = list(lora_adapters(model))
    if len(adapters) != len(snapshot.tensors):
        raise ValueError(f"snapshot of {len(snapshot.tensors)} adapters, model has {len(adapters)}")
    for adapter, pairs in zip(adapters, snapshot.tensors, strict=True):
        for part, (a, b) in zip(adapter.parts.values(), pairs, strict=True):
            a.copy_(part.lora_A)
            b.copy_(part.lora_B)


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """Within the block ``model`` computes its frozen base alone (every adapter adds nothing)."""
    adapters = list(lora_adapters(model))
    before = [a.off for a in adapters]
    try:
        for a in adapters:
            a.off = True
        yield
    finally:
        for a, off in zip(adapters, before, strict=True):
            a.off = off


@contextlib.contextmanager
def adapters_from(model: torch.nn.Module, snapshot: AdapterSnapshot) -> Iterator[None]:
    """Within the block ``model``'s adapters compute with ``snapshot``'s tensors (no dropout)."""
    adapters = list(lora_adapters(model))
    if len(adapters) != len(snapshot.tensors):
        raise ValueError(f"snapshot of {len(snapshot.tensors)} adapters, model has {len(adapters)}")
    before = [a.swapped for a in adapters]
    try:
        for a, pairs in zip(adapters, snapshot.tensors, strict=True):
            a.swapped = pairs
        yield
    finally:
        for a, swapped in zip(adapters, before, strict=True):
            a.swapped = swapped
