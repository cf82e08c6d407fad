"""megatron_rl.rewards: answer extraction, the builtins on hand-written responses, calls from a
non-main thread (math-verify's signal timeouts), and loading by dotted path."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from megatron_rl.data import PromptRecord, load_records
from megatron_rl.rewards import (
    RewardFn,
    exact_match_reward,
    extract_boxed,
    load_reward_fn,
    math_verify_reward,
    reasoning_gym_reward,
)

ROOT = Path(__file__).resolve().parents[1]


def _record(answer: str) -> PromptRecord:
    return PromptRecord(prompt_id="p", text="question", answer=answer)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is \\boxed{15}.", "15"),
        ("\\boxed{1} then \\boxed{ \\frac{1}{2} }", "\\frac{1}{2}"),
        ("\\fbox{x^{2}}", "x^{2}"),
        ("\\boxed {7}", "7"),
        ("\\boxed{3} and \\boxed{unclosed", "3"),
        ("no box: 15", None),
        ("\\boxed{never closed", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# Hand-written (response, reference answer, expected reward) for math_verify.
MATH_CASES = [
    ("7 + 8 = 15, so \\boxed{15}", "15", 1.0),
    ("\\boxed{16}", "15", 0.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.5", 0.0),
    ("\\boxed{1,234}", "1234", 1.0),
    ("\\boxed{-4}", "-4", 1.0),
    ("\\boxed{4}", "-4", 0.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("The answer is 15.", "15", 0.0),  # no \boxed{}: the format asked for is required
    ("\\boxed{Blue}", "blue", 1.0),  # not maths: compared as normalised text
]


@pytest.mark.parametrize(("response", "answer", "expected"), MATH_CASES)
def test_math_verify_reward(response, answer, expected):
    assert math_verify_reward(_record(answer), response) == expected


def test_math_verify_reward_from_a_thread():
    from math_verify import parse

    def run(out: dict) -> None:
        try:  # the library alone, with its default signal timeout, refuses to run here
            parse("\\boxed{1}")
        except ValueError as err:
            out["library_error"] = str(err)
        out["rewards"] = [math_verify_reward(_record(a), r) for r, a, _ in MATH_CASES]

    out: dict = {}
    thread = threading.Thread(target=run, args=(out,))
    thread.start()
    thread.join()
    assert "threaded environment" in out["library_error"]
    assert out["rewards"] == [expected for _, _, expected in MATH_CASES]


@pytest.mark.slow
def test_costly_answer_from_a_thread_returns_quickly():
    # 9^{9^9} makes sympy compute a 370-million-digit integer in C, holding the GIL for
    # minutes; run in a subprocess so a regression fails by timeout instead of hanging pytest.
    code = textwrap.dedent("""
        import threading, time
        from megatron_rl.data import PromptRecord
        from megatron_rl.rewards import math_verify_reward
        rec = PromptRecord(prompt_id="p", text="q", answer="3")
        out = []
        t = threading.Thread(target=lambda: out.extend(
            math_verify_reward(rec, r) for r in ("\\\\boxed{9^{9^{9}}}", "\\\\boxed{10^{100000}}",
                                                 "\\\\boxed{100000!}", "\\\\boxed{3}")))
        t.start(); t.join()
        print(out)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[0.0, 0.0, 0.0, 1.0]"


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("\\boxed{42}", "42", 1.0),
        ("\\boxed{ $42$ }", "42", 1.0),
        ("\\boxed{\\text{Blue}.}", "blue", 1.0),
        ("\\boxed{1,234}", "1234", 1.0),
        ("\\boxed{42.0}", "42", 0.0),  # string equality, not numeric
        ("\\boxed{4 2}", "42", 0.0),
        ("42", "42", 0.0),
    ],
)
def test_exact_match_reward(response, answer, expected):
    assert exact_match_reward(_record(answer), response) == expected


def test_reasoning_gym_reward_uses_the_dataset_scorer():
    import reasoning_gym

    record = load_records("reasoning_gym:countdown", size=1, seed=5)[0]
    dataset = reasoning_gym.create_dataset("countdown", size=1, seed=5)
    entry = dataset[0]
    assert reasoning_gym_reward(record, f"I get \\boxed{{{entry['answer']}}}") == 1.0
    wrong = "1 + 1"
    assert reasoning_gym_reward(record, f"\\boxed{{{wrong}}}") == dataset.score_answer(wrong, entry)
    assert reasoning_gym_reward(record, "no box") == dataset.score_answer(None, entry)
    with pytest.raises(ValueError, match="reasoning_gym:<name>"):
        reasoning_gym_reward(_record("1"), "\\boxed{1}")


# ---------------------------------------------------------------- loading


def contains_answer(record: PromptRecord, response_text: str) -> float:
    """Reference user reward: 1.0 if the reference answer appears anywhere in the response."""
    return float(record.answer in response_text)


class _LengthPenalty:
    def __call__(self, record: PromptRecord, response_text: str) -> float:
        return -len(response_text) / 100


length_penalty = _LengthPenalty()


def one_argument(record: PromptRecord) -> float:
    return 0.0


def test_load_builtins():
    assert load_reward_fn("math_verify") is math_verify_reward
    assert load_reward_fn("exact_match") is exact_match_reward
    assert load_reward_fn("reasoning_gym") is reasoning_gym_reward


def test_load_reference_implementation_by_dotted_path():
    fn = load_reward_fn("tests.test_rewards:contains_answer")
    assert isinstance(fn, RewardFn)
    assert fn(_record("15"), "it is 15") == 1.0 and fn(_record("15"), "it is 16") == 0.0
    assert load_reward_fn("tests.test_rewards:length_penalty")(_record("1"), "x" * 50) == -0.5


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ("no_such_builtin", "must be one of"),
        ("tests.no_such_module:f", "cannot import module"),
        ("tests.test_rewards:missing", "has no attribute 'missing'"),
        ("tests.test_rewards:_LengthPenalty", "function or callable instance"),
        ("tests.test_rewards:ROOT", "function or callable instance"),
        ("tests.test_rewards:one_argument", "cannot be called as fn"),
    ],
)
def test_load_errors(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_reward_fn(spec)


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("7 + 8 = 15", "15", 1.0),
        ("The answer is 15.", "15", 1.0),
        ("First 12 then 30, so 42", "42", 1.0),
        ("It is 1,234 in total", "1234", 1.0),
        ("-3.0", "-3", 1.0),
        ("I get 16", "15", 0.0),
        ("15 is not it, 16 is", "15", 0.0),  # the last number counts
        ("no digits here", "15", 0.0),
        ("\\boxed{15} and then 99", "15", 1.0),  # a boxed answer wins over later numbers
        ("anything 3", "three", 0.0),  # a non-numeric reference never matches
    ],
)
def test_last_number_reward(response, answer, expected):
    from megatron_rl.rewards import last_number_reward

    assert last_number_reward(_record(answer), response) == expected
    assert load_reward_fn("last_number") is last_number_reward
