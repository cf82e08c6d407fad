"""The shipped environments: the calculator against reasoning_gym's own answers, the tool task's
turns (tool calls run, errors counted, the final answer scored by reasoning_gym's scorer) with
the calculator and the sandboxed Python tool, and the deterministic toy."""

from __future__ import annotations

import json

import pytest

from megatron_rl.data.sources import reasoning_gym_records
from megatron_rl.environments import load_environment, record_fields
from megatron_rl.environments.calculator import CalculatorError, evaluate

BIG = {"min_digits": 5, "max_digits": 7, "min_terms": 2, "max_terms": 3}


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _expression(question: str) -> str:
    """The arithmetic of a reasoning_gym 'products' / 'chain_sum' question."""
    return question.split(": ", 1)[1].split(". Give", 1)[0].rstrip(" =?")


@pytest.mark.parametrize("name", ["products", "chain_sum"])
def test_calculator_matches_reasoning_gym_answers(name):
    for record in reasoning_gym_records(name, size=20, seed=3, options=BIG):
        assert str(evaluate(_expression(record.text))) == record.answer


@pytest.mark.parametrize(
    ("expression", "words"),
    [
        ("__import__('os').system('true')", "unsupported"),
        ("open('x')", "unsupported"),
        ("a + 1", "unsupported"),
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "exponent too large"),
        ("'a' * 3", "unsupported"),
        ("(10 ** 3000) * (10 ** 3000)", "digits"),
        ("1 +", "not an arithmetic"),
        ("", "non-empty"),
    ],
)
def test_calculator_refuses(expression, words):
    with pytest.raises(CalculatorError, match=words):
        evaluate(expression)


@pytest.mark.parametrize("kind", ["calculator", "python"])
def test_tool_task_turns(kind):
    record = reasoning_gym_records("products", size=1, seed=0, options=BIG)[0]
    env = load_environment(kind, sandbox={"wall_s": 5.0})() if kind == "python" else load_environment(kind)()
    first = env.reset(record_fields(record, instruction="Box it."))
    assert first[-1]["content"].startswith(record.text) and "tool" in first[-1]["content"]
    expression = _expression(record.text)
    arguments = {"expression": expression} if kind == "calculator" else {"code": f"print({expression})"}
    call = _call(kind, **arguments)
    turn = env.step(f"Let me compute.\n{call}\n{_call('nope')}<tool_call>{{bad json</tool_call>")
    assert not turn.done and (turn.tool_calls, turn.tool_errors) == (3, 2)
    assert [m["role"] for m in turn.observation] == ["tool"] * 3
    assert turn.observation[0]["content"] == record.answer  # the tool's result, exact
    assert "no tool named 'nope'" in turn.observation[1]["content"]
    assert env.step(f"The product is \\boxed{{{record.answer}}}.").reward == 1.0
    assert env.step("The product is \\boxed{12}.").reward == 0.0


@pytest.mark.parametrize(
    ("kind", "options", "words"),
    [
        ("python", {"sandbox": {"cpu_s": 0}}, "positive"),
        ("python", {"sandbox": {"cpux": 1}}, "cpux"),
        ("calculator", {"max_tool_calls": 0}, "max_tool_calls"),
        ("calculator", {"sandbox": {}}, "sandbox"),
        ("calculator", {"demonstration": [{"role": "bot", "content": "x"}]}, r"demonstration\[0\]"),
        ("calculator", {"demonstration": "Q: 1+1 A: 2"}, "list of chat messages"),
    ],
)
def test_tool_task_refuses_bad_options(kind, options, words):
    with pytest.raises(ValueError, match=words) as err:
        load_environment(kind, **options)
    assert str(err.value).startswith("environment.options:")


def test_tool_task_caps_calls_per_turn():
    env = load_environment("calculator", max_tool_calls=2)()
    env.reset({"messages": [{"role": "user", "content": "q"}], "metadata": {}})
    turn = env.step(_call("calculator", expression="1+1") * 3)
    assert (turn.tool_calls, turn.tool_errors) == (3, 1) and "at most 2" in turn.observation[2]["content"]
    assert env.step("\\boxed{2}").reward is None  # not a reasoning_gym record: the reward function scores


def test_tool_task_demonstration_comes_after_the_system_messages():
    demo = [
        {"role": "user", "content": "2*3?"},
        {"role": "assistant", "content": _call("calculator", expression="2*3")},
        {"role": "tool", "content": "6"},
        {"role": "assistant", "content": "\\boxed{6}"},
    ]
    env = load_environment("calculator", demonstration=demo, instruction="Use it.")()
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "4*5?"}]
    question = {"role": "user", "content": "4*5?\n\nUse it."}
    assert env.reset({"messages": chat, "metadata": {}}) == [chat[0], *demo, question]
    assert env.reset({"messages": chat[1:], "metadata": {}})[:4] == demo


def test_echo_counter_counts_tool_calls():
    env = load_environment("echo", turns=2)()
    env.reset({"messages": [{"role": "user", "content": "q"}]})
    first = env.step(_call("calculator", expression="1") + "<tool_call>oops")
    assert (first.done, first.tool_calls, first.tool_errors) == (False, 2, 1)
    assert env.step("").done


def test_the_tool_example_demonstrates_correct_tool_use():
    """examples/tool_calc_smollm2's worked examples: each demonstrated call, run by the calculator
    task, gives the demonstrated tool result, and the answer after it boxes that result."""
    from pathlib import Path

    import yaml

    from megatron_rl.rewards.base import extract_boxed

    config = Path(__file__).resolve().parents[1] / "examples" / "tool_calc_smollm2" / "config.yaml"
    options = yaml.safe_load(config.read_text())["environment"]["options"]
    env, demo = load_environment("calculator", **options)(), options["demonstration"]
    calls = [i for i, m in enumerate(demo) if m["role"] == "assistant" and "<tool_call>" in m["content"]]
    assert calls
    for i in calls:
        turn = env.step(demo[i]["content"])
        assert (turn.tool_calls, turn.tool_errors) == (1, 0)
        assert [m["content"] for m in turn.observation] == [demo[i + 1]["content"]]
        assert demo[i + 1]["role"] == "tool" and extract_boxed(demo[i + 2]["content"]) == demo[i + 1]["content"]
        assert options["instruction"] in demo[i - 1]["content"]  # the examples ask what the question asks
