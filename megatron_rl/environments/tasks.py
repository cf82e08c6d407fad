"""Shipped environments: a deterministic toy for tests, and reasoning_gym tasks that need a tool.

Contract: each class is an `Environment` factory (one instance per trajectory) taking keyword
options (``environment.options``):
- `EchoCounter(turns=2)`: no randomness, no tools; after each model turn it answers one user
  message naming the turn and the turn's length in characters, and is done after `turns` model
  turns. Its observations depend only on the model's text, so periodic == sync holds with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_rl.environments.base import Message, StepResult


class EchoCounter:
    """Deterministic toy environment: fixed observations, done after `turns` model turns."""

    tools: tuple[dict, ...] = ()

    def __init__(self, *, turns: int = 2):
        if not isinstance(turns, int) or turns < 1:
            raise ValueError(f"turns must be an integer >= 1, got {turns!r}")
        self.turns, self.turn = turns, 0

    def reset(self, record: Mapping[str, Any]) -> list[Message]:
        """The record's own chat (its `messages`)."""
        self.turn = 0
        return [dict(m) for m in record["messages"]]

    def step(self, model_turn: str) -> StepResult:
        """A user message naming the turn and its length; done after `turns` turns."""
        self.turn += 1
        if self.turn >= self.turns:
            return StepResult(observation=(), done=True)
        text = f"Turn {self.turn}: you wrote {len(model_turn)} characters. Go on."
        return StepResult(observation=({"role": "user", "content": text},), done=False)
