"""What LoRA adapts and how strongly: ``LoraSettings``, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rl.config.schema_lora import LORA_TARGETS


@dataclass(frozen=True)
class LoraSettings:
    """Rank, alpha (scale = alpha / rank, PEFT's default, not rsLoRA), dropout on the adapter's
    input, the megatron linears to adapt by name, and the seed of the adapters' A initialisation
    (the same full A at every TP / PP layout)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_TARGETS
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraSettings.rank must be an integer >= 1, got {self.rank!r}")
        if not isinstance(self.alpha, int | float) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"LoraSettings.alpha must be a finite number > 0, got {self.alpha!r}")
        if not isinstance(self.dropout, int | float) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSettings.dropout must be in [0, 1), got {self.dropout!r}")
        targets = tuple(self.target_modules)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if not targets or unknown or len(set(targets)) != len(targets):
            raise ValueError(
                f"LoraSettings.target_modules must be distinct names among {LORA_TARGETS}, got {targets!r}"
            )
        object.__setattr__(self, "target_modules", targets)

    @property
    def scale(self) -> float:
        """The factor on the adapter's output: alpha / rank."""
        return self.alpha / self.rank
