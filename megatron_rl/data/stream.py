"""A deterministic, resumable stream of prompt batches: `prompts_per_batch` items per step.

Contract: the stream is the concatenation of per-epoch permutations of the items, epoch e
shuffled by `numpy.random.default_rng([seed, e])` (independent of how many batches were
drawn before), cut into consecutive batches of `prompts_per_batch`. A batch may span two
epochs: no item is skipped and every epoch visits every item exactly once. `state_dict()`
is {"epoch", "position"} (plain ints, the position inside that epoch's permutation);
`load_state_dict(state_dict())` on a stream over the same items with the same seed yields
the same future batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Generic, TypeVar

import numpy as np

from megatron_rl.config.fields import require_values

T = TypeVar("T")


class PromptStream(Generic[T]):
    """Endless epoch-shuffled batches over `items` (PromptRecords or TokenizedPrompts)."""

    def __init__(self, items: Sequence[T], *, prompts_per_batch: int, seed: int) -> None:
        require_values({"trainer.prompts_per_batch": prompts_per_batch})  # the config's rule
        if prompts_per_batch > len(items):
            raise ValueError(
                f"prompts_per_batch ({prompts_per_batch}) exceeds the number of prompts "
                f"({len(items)}): a batch would repeat a prompt"
            )
        self._items, self._batch, self._seed = list(items), prompts_per_batch, seed
        self._epoch, self._position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._items))

    def next_batch(self) -> list[T]:
        """The next `prompts_per_batch` items, in stream order."""
        batch = []
        while len(batch) < self._batch:
            take = min(self._batch - len(batch), len(self._order) - self._position)
            batch += [self._items[i] for i in self._order[self._position : self._position + take]]
            self._position += take
            if self._position == len(self._order):
                self._epoch, self._position = self._epoch + 1, 0
                self._order = self._permutation(self._epoch)
        return batch

    def __iter__(self) -> Iterator[list[T]]:
        while True:
            yield self.next_batch()

    @property
    def epoch(self) -> int:
        """Epoch of the next item to be drawn (0-based)."""
        return self._epoch

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands: {"epoch", "position"} (plain ints)."""
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume from a `state_dict()` of a stream over the same items and seed."""
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self._items):
            raise ValueError(f"stream state {dict(state)!r} out of range for {len(self._items)} prompts")
        self._epoch, self._position = epoch, position
        self._order = self._permutation(epoch)
