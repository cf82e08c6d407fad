"""``EngineWrapper``: the base of engines that wrap another one (``train(engine_factory=...)``).

A wrapper changes what it needs, usually ``generate`` (record results, inject faults, reorder,
route to a remote service) and forwards everything else of the ``RolloutEngine`` contract to
``inner`` unchanged, so the weight-version bookkeeping stays the wrapped engine's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from megatron_rl.rollout.types import GenerationRequest, GenerationResult, RolloutEngine


class EngineWrapper:
    """A ``RolloutEngine`` forwarding every call to ``inner``; subclasses override what they change."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner = inner

    def generate(self, requests: Sequence[GenerationRequest]) -> Iterator[GenerationResult]:
        return self.inner.generate(requests)

    def update_weights(self, snapshot_dir: str, version: int) -> None:
        self.inner.update_weights(snapshot_dir, version)

    def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                                    **peers) -> None:
        self.inner.update_weights_from_tensors(named_tensors, version, **peers)  # peers= at PP > 1

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def shutdown(self) -> None:
        self.inner.shutdown()

    def __getattr__(self, name: str):  # status(), ... of the wrapped pool
        return getattr(self.inner, name)
