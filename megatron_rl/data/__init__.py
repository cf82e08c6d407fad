"""Prompt datasets: sources -> typed records -> prompt token ids -> a resumable batch stream.

    records = load_records(cfg.source, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                           size=cfg.size, seed=cfg.seed)
    tokenized = tokenize_records(records, tokenizer, chat_template=cfg.chat_template,
                                 max_prompt_tokens=cfg.max_prompt_tokens)
    stream = PromptStream(tokenized.prompts, prompts_per_batch=8, seed=cfg.seed)

Modules: `records` (PromptRecord, ChatMessage, TokenizedPrompt), `sources` (reasoning_gym,
.jsonl, .parquet), `tokenization` (answer instruction, chat template, length limit),
`prompts` (`load_prompts`: both steps, with a `DataReport` of what was skipped and why),
`stream` (PromptStream).
"""

from megatron_rl.data.prompts import DataReport, load_prompts
from megatron_rl.data.records import ChatMessage, PromptRecord, TokenizedPrompt
from megatron_rl.data.sources import SourceRecords, load_records, read_records, reasoning_gym_records, record_from_row
from megatron_rl.data.stream import PromptStream
from megatron_rl.data.tokenization import (
    ANSWER_INSTRUCTION,
    TokenizedRecords,
    render_chat,
    tokenize_prompt,
    tokenize_records,
)

__all__ = [
    "ANSWER_INSTRUCTION",
    "ChatMessage",
    "DataReport",
    "PromptRecord",
    "PromptStream",
    "SourceRecords",
    "TokenizedPrompt",
    "TokenizedRecords",
    "load_prompts",
    "load_records",
    "read_records",
    "reasoning_gym_records",
    "record_from_row",
    "render_chat",
    "tokenize_prompt",
    "tokenize_records",
]
