"""The typed records that leave `data/`: one prompt with its reference answer, and its tokens.

Contract: a `PromptRecord` holds exactly one of `text` (a plain user prompt) or `messages` (a
chat conversation ending with a user turn); `answer` is the reference answer as a string.
`metadata` carries source-specific extras (read-only by convention), e.g. the reasoning_gym
entry the `reasoning_gym` reward needs. A `TokenizedPrompt` pairs a record with the token ids
the rollout engine receives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, kw_only=True)
class ChatMessage:
    """One turn of a chat conversation."""

    role: str  # "system", "user" or "assistant"
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"message role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise ValueError(f"message content must be a string, got {type(self.content).__name__}")


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    """A prompt, its reference answer, and where it came from."""

    prompt_id: str  # unique and stable across runs, e.g. "basic_arithmetic:0:17" or "train.jsonl:12"
    answer: str  # reference answer
    text: str | None = None  # plain user prompt, or None when `messages` is given
    messages: tuple[ChatMessage, ...] | None = None  # chat conversation, last turn from the user
    metadata: Mapping[str, Any] = field(default_factory=dict)  # source-specific extras

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError(f"prompt {self.prompt_id!r}: give exactly one of text or messages")
        if self.messages is not None and (not self.messages or self.messages[-1].role != "user"):
            raise ValueError(f"prompt {self.prompt_id!r}: messages must end with a user turn")

    def chat(self) -> list[ChatMessage]:
        """The prompt as chat messages (a plain `text` becomes one user turn)."""
        if self.messages is not None:
            return list(self.messages)
        return [ChatMessage(role="user", content=self.text)]


@dataclass(frozen=True, kw_only=True)
class TokenizedPrompt:
    """A record and the prompt token ids sent to the rollout engine."""

    record: PromptRecord
    token_ids: tuple[int, ...]  # [prompt_len]; chat template and answer instruction included
