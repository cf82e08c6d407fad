"""Builtin reward functions: `math_verify`, `exact_match`, `reasoning_gym`, `last_number`
(1.0 right, 0.0 wrong).

The first three read the final answer with `extract_boxed` (the last `\\boxed{...}`); a response
without one scores 0.0 (`reasoning_gym` leaves that to the dataset's scorer, which gets None).
`last_number` is the lenient GSM8K-style check for models that do not follow the answer
format (small models rarely write `\\boxed{}`): the boxed answer if there is one, else the
last number in the response, compared numerically with the reference.

math-verify thread safety: its `parse`/`verify` time out with `signal.alarm`, which raises
ValueError outside the main thread. `math_verify_reward` keeps math-verify's timeouts in the
main thread and turns them off in any other thread (the producer thread). Off the main thread
nothing can interrupt sympy (not even an asynchronous exception: the slow part is one C-level
big-integer operation holding the GIL, measured), so instead the predicted expression is
refused (score 0.0) before comparison when it could be that costly: an answer longer than
`MAX_ANSWER_CHARS`, a power tower such as 9^{9^9}, a numeric exponent above `MAX_EXPONENT`, or
a factorial of more than `MAX_FACTORIAL`. Reference answers are trusted.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable
from typing import Any

from megatron_rl.data.records import PromptRecord
from megatron_rl.rewards.base import extract_boxed

MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own default, main thread only
MAX_ANSWER_CHARS = 512
MAX_EXPONENT = 10_000
MAX_FACTORIAL = 10_000

_THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")
_TEXT = re.compile(r"\\text\s*\{([^{}]*)\}")


def math_verify_reward(record: PromptRecord, response_text: str) -> float:
    """1.0 if the boxed answer is mathematically equal to `record.answer` (math-verify), else 0.0."""
    from math_verify import parse, verify

    predicted = extract_boxed(response_text)
    if predicted is None or len(predicted) > MAX_ANSWER_CHARS:
        return 0.0
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{record.answer}}}", parsing_timeout=timeout)
    if not gold:  # an answer math-verify cannot read (e.g. a word): compare as text
        return float(normalize_answer(predicted) == normalize_answer(record.answer))
    target = parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
    if not target or any(_too_costly(t) for t in target):
        return 0.0
    return float(verify(gold, target, timeout_seconds=timeout))


def exact_match_reward(record: PromptRecord, response_text: str) -> float:
    """1.0 if the boxed answer equals `record.answer` after `normalize_answer`, else 0.0."""
    predicted = extract_boxed(response_text)
    return float(predicted is not None and normalize_answer(predicted) == normalize_answer(record.answer))


_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def last_number_reward(record: PromptRecord, response_text: str) -> float:
    """1.0 if the boxed answer, or else the last number in the response, equals `record.answer`
    as a number (1,234 = 1234 = 1234.0), else 0.0."""
    boxed = extract_boxed(response_text)
    numbers = _NUMBER.findall(boxed if boxed is not None else response_text)
    if not numbers:
        return 0.0
    try:
        predicted = float(numbers[-1].replace(",", ""))
        gold = float(normalize_answer(record.answer).replace(",", ""))
    except ValueError:
        return 0.0
    return float(predicted == gold)


def reasoning_gym_reward(record: PromptRecord, response_text: str) -> float:
    """The reasoning_gym dataset's own `score_answer(boxed answer or None, entry)`, in [0, 1]."""
    name, entry = record.metadata.get("reasoning_gym"), record.metadata.get("entry")
    if name is None or entry is None:
        raise ValueError(
            f"reward 'reasoning_gym' needs a record from a 'reasoning_gym:<name>' source; "
            f"prompt {record.prompt_id!r} has no reasoning_gym entry in its metadata"
        )
    return float(_score_answer_fn(name)(answer=extract_boxed(response_text), entry=entry))


def normalize_answer(text: str) -> str:
    """Canonical string of an answer: no surrounding $ or spaces, \\text{x} -> x, no trailing
    period, single spaces, case-folded, and 1,234 -> 1234."""
    text = text.strip().strip("$").strip()
    text = _TEXT.sub(r"\1", text).rstrip(".").strip()
    text = " ".join(text.split()).casefold()
    return text.replace(",", "") if _THOUSANDS.fullmatch(text) else text


def _too_costly(expr: Any) -> bool:
    """True when comparing sympy expression `expr` could run for minutes (see module doc)."""
    import sympy

    if not isinstance(expr, sympy.Basic):
        return False  # math-verify's raw-string fallback: compared as text
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow) and not node.exp.free_symbols:
            if node.exp.has(sympy.Pow) or (node.exp.is_Number and abs(node.exp) > MAX_EXPONENT):
                return True
        if isinstance(node, sympy.factorial) and node.args[0].is_Number and node.args[0] > MAX_FACTORIAL:
            return True
    return False


@functools.cache
def _score_answer_fn(name: str) -> Callable[..., float]:
    """reasoning_gym's scorer for dataset `name` (a default-config instance; scorers use the entry)."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


BUILTIN_REWARDS: dict[str, Callable[[PromptRecord, str], float]] = {
    "math_verify": math_verify_reward,
    "exact_match": exact_match_reward,
    "reasoning_gym": reasoning_gym_reward,
    "last_number": last_number_reward,
}
