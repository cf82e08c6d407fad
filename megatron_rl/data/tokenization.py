"""Prompt records -> prompt token ids, with the answer-format instruction and a length limit.

Contract:
- The answer format is LaTeX `\\boxed{...}`: `ANSWER_INSTRUCTION` is appended (after a blank
  line) to the last user turn, and every builtin reward reads the content of the *last*
  `\\boxed{...}` of a response (`megatron_rl.rewards.extract_boxed`). math-verify parses
  `\\boxed{}` natively, and it is the convention instruct/math models are trained on.
- chat_template=True renders the chat with `tokenizer.apply_chat_template(...,
  add_generation_prompt=True)` and tokenizes that text without adding special tokens (the
  template has them). chat_template=False tokenizes the plain text with the tokenizer's
  special tokens (e.g. a BOS); a record with `messages` needs the chat template.
- Over-long prompts (more than `max_prompt_tokens` tokens, everything included) are dropped,
  not truncated: `tokenize_prompt` returns None, `tokenize_records` drops and counts them
  and logs the count; it raises ValueError if nothing is left.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl.config.schema import DataConfig
from megatron_rl.data.records import ChatMessage, PromptRecord, TokenizedPrompt

logger = logging.getLogger(__name__)

ANSWER_INSTRUCTION = DataConfig.instruction  # data.instruction's default


@dataclass(frozen=True, kw_only=True)
class TokenizedRecords:
    """Result of `tokenize_records`: the prompts kept and the ids of those dropped."""

    prompts: list[TokenizedPrompt]  # in input order
    dropped_ids: list[str]  # prompt_id of every prompt longer than max_prompt_tokens


def render_chat(record: PromptRecord, *, instruction: str | None = ANSWER_INSTRUCTION) -> list[ChatMessage]:
    """The record's chat with `instruction` appended (after a blank line) to the last user turn."""
    chat = record.chat()
    if instruction:
        last = chat[-1]
        chat[-1] = ChatMessage(role=last.role, content=f"{last.content}\n\n{instruction}")
    return chat


def tokenize_prompt(
    record: PromptRecord,
    tokenizer: Any,
    *,
    chat_template: bool,
    max_prompt_tokens: int,
    instruction: str | None = ANSWER_INSTRUCTION,
) -> list[int] | None:
    """Prompt token ids [prompt_len] of `record` (see module doc); None if longer than max_prompt_tokens."""
    if max_prompt_tokens <= 0:
        raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
    chat = render_chat(record, instruction=instruction)
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "chat_template=True but the tokenizer has no chat template: "
                "set data.chat_template=false or use an instruct tokenizer"
            )
        text = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in chat], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        if record.messages is not None:
            raise ValueError(f"prompt {record.prompt_id!r} is a chat (messages) and needs chat_template=True")
        ids = tokenizer(chat[0].content, add_special_tokens=True)["input_ids"]
    return list(ids) if len(ids) <= max_prompt_tokens else None


def tokenize_records(
    records: Sequence[PromptRecord],
    tokenizer: Any,
    *,
    chat_template: bool,
    max_prompt_tokens: int,
    instruction: str | None = ANSWER_INSTRUCTION,
) -> TokenizedRecords:
    """Tokenize every record, dropping (and counting, and logging) the over-long ones."""
    kept, dropped = [], []
    for record in records:
        ids = tokenize_prompt(
            record, tokenizer, chat_template=chat_template, max_prompt_tokens=max_prompt_tokens, instruction=instruction
        )
        if ids is None:
            dropped.append(record.prompt_id)
        else:
            kept.append(TokenizedPrompt(record=record, token_ids=tuple(ids)))
    if dropped:
        logger.warning(
            "dropped %d of %d prompts longer than max_prompt_tokens=%d (first: %s)",
            len(dropped),
            len(records),
            max_prompt_tokens,
            dropped[0],
        )
    if not kept:
        raise ValueError(
            f"every one of the {len(records)} prompts is longer than "
            f"max_prompt_tokens={max_prompt_tokens}: raise data.max_prompt_tokens"
        )
    return TokenizedRecords(prompts=kept, dropped_ids=dropped)
