"""Random-token prompts and a length-parity reward: the engine-side benchmarks' workload
(``bench oversample``, ``bench partial_rollout``), with no tokenizer or data set."""

from __future__ import annotations

import random

from megatron_rl.data.records import PromptRecord, TokenizedPrompt

PROMPT_TOKENS = 8


def random_prompts(rng: random.Random, *, step: int, count: int, vocab: int) -> tuple[TokenizedPrompt, ...]:
    """``count`` prompts of ``PROMPT_TOKENS`` ids drawn from ``rng`` in [3, vocab), named
    ``s<step>p<i>``."""
    return tuple(
        TokenizedPrompt(
            record=PromptRecord(prompt_id=f"s{step}p{i}", answer="", text=""),
            token_ids=tuple(rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)),
        )
        for i in range(count)
    )


def parity_reward(record, text: str) -> float:
    """1 if the response text has an even length, else 0 (varied, so groups keep a signal)."""
    return float(len(text) % 2 == 0)
