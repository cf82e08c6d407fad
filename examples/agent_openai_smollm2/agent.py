"""The calculator task of examples/tool_calc_smollm2, as an agent written against the OpenAI API.

Plain ``openai`` client code: nothing here knows it is being trained. megatron_rl runs
``solve(task, base_url)`` once per trajectory (``rollout.generator: agent``) with ``base_url``
pointing at the rollout gateway; the gateway keeps the exact tokens the engine sampled. The
same prompt as the native example (the tool block, two worked examples, the instruction), the
same tool (megatron_rl's calculator, exact arithmetic), the same score (reasoning_gym's on the
last \\boxed{} of the final turn), so the two reward curves can be compared.
"""

from __future__ import annotations

import json

from openai import OpenAI

from megatron_rl.environments.calculator import CALCULATOR_TOOL, call_calculator
from megatron_rl.environments.template import parse_tool_calls
from megatron_rl.rewards.base import extract_boxed

INSTRUCTION = "Call the calculator tool, then give the result as \\boxed{number}."
MAX_TURNS = 3


def _example(a: int, b: int) -> list[dict]:
    question = f"Solve the following multiplication: {a} * {b}. Give only the result as your final answer."
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
    return [
        {"role": "user", "content": f"{question}\n\n{INSTRUCTION}"},
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"\\boxed{{{a * b}}}"},
    ]


DEMONSTRATION = [*_example(237, 48), *_example(519, 763)]


def solve(task: dict, base_url: str) -> float | None:
    """Answer ``task`` with the calculator; the reward of the final answer (None: not gradable)."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    question = task["messages"][-1]["content"]
    messages = [*DEMONSTRATION, {"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}]
    text = ""
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        text = message.content or ""
        if reply.choices[0].finish_reason == "length":
            break
        if not message.tool_calls:
            # A malformed <tool_call> comes back as plain content (as from an OpenAI server); the
            # native environment answers it with an error and another turn, so this agent does too.
            malformed = [c for c in parse_tool_calls(text) if c.error is not None]
            if not malformed:
                break
            messages += [{"role": "tool", "content": f"Error: malformed tool call ({c.error})"} for c in malformed[:2]]
            continue
        for call in message.tool_calls[:2]:
            name = call.function.name
            result = (
                call_calculator(json.loads(call.function.arguments))[0]
                if name == "calculator"
                else f"Error: no tool named {name!r}; the tools are calculator"  # the native environment's answer
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return _score(task, text)


def _score(task: dict, final_text: str) -> float | None:
    """reasoning_gym's scorer on the final turn's last \\boxed{} (the native example's score)."""
    metadata = task.get("metadata") or {}
    name, entry = metadata.get("reasoning_gym"), metadata.get("entry")
    if name is None or entry is None:
        return None
    import reasoning_gym

    return float(reasoning_gym.get_score_answer_fn(name)(answer=extract_boxed(final_text), entry=entry))
