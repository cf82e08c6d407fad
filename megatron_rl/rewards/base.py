"""The reward-function contract, and the final-answer extraction every builtin shares.

A reward function maps (prompt record, decoded response text) to a float. The producer
thread calls it, so it must work off the main thread (no `signal`-based timeouts there),
must not mutate the record, and should be cheap (it runs once per response).

The answer format is the one `megatron_rl.data.ANSWER_INSTRUCTION` asks for: the content of
the last `\\boxed{...}` of the response (braces balanced; `\\fbox{...}` is accepted too).
"""

from __future__ import annotations

import re
from typing import Protocol, runtime_checkable

from megatron_rl.data.records import PromptRecord

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


@runtime_checkable
class RewardFn(Protocol):
    """Scores one response to one prompt."""

    def __call__(self, record: PromptRecord, response_text: str) -> float:
        """Reward of `response_text` (the decoded response, without the prompt) for `record`."""
        ...


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text` (stripped), or None if there is no closed one."""
    for match in reversed(list(_BOX.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None
