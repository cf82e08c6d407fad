"""Shipped environments: a deterministic toy for tests, and reasoning_gym tasks that need a tool.

Contract: each class is an `Environment` factory (one instance per trajectory) taking keyword
options (``environment.options``):
- `EchoCounter(turns=2)`: no randomness, no tools; after each model turn it answers one user
  message naming the turn and the turn's length in characters, and is done after `turns` model
  turns. It counts the turn's <tool_call> blocks (and the malformed ones as tool errors).
  Its observations depend only on the model's text, so periodic == sync holds with it.
- `ToolTask(tools=("calculator",), ...)`: the record's chat plus a tool instruction; each model
  turn's <tool_call> blocks are run (at most `max_tool_calls`) and answered with one "tool"
  message each; a turn without a tool call is the final answer: done, and the reward is
  reasoning_gym's own scorer on its last \\boxed{} when the record comes from a
  ``reasoning_gym:<name>`` source (else None: the task's reward function scores).
  `CalculatorArithmetic` (calculator tool) and `PythonArithmetic` (sandboxed Python tool) are
  ToolTasks; their data are e.g. ``reasoning_gym:products`` with big operands
  (``data.options: {min_digits: 5, max_digits: 7}``). ``demonstration``: chat messages of a
  worked example (a question, the assistant's tool call, the tool's result, the boxed answer)
  placed before the record's question (after its system messages): a one-shot demonstration of
  the call format for a small model, the same for every trajectory (shared prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megatron_rl.environments.base import Message, StepResult
from megatron_rl.environments.calculator import CALCULATOR_TOOL, call_calculator
from megatron_rl.environments.sandbox import PYTHON_TOOL, SandboxLimits, call_python
from megatron_rl.environments.template import ToolCall, parse_tool_calls
from megatron_rl.rewards.base import extract_boxed

ToolFn = Callable[[dict], tuple[str, bool]]  # arguments -> (observation text, succeeded)


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
        calls = parse_tool_calls(model_turn)
        counts = {"tool_calls": len(calls), "tool_errors": sum(c.error is not None for c in calls)}
        if self.turn >= self.turns:
            return StepResult(observation=(), done=True, **counts)
        text = f"Turn {self.turn}: you wrote {len(model_turn)} characters. Go on."
        return StepResult(observation=({"role": "user", "content": text},), done=False, **counts)


class ToolTask:
    """A question answered with tools, scored on the final turn (see module doc)."""

    def __init__(
        self,
        *,
        tools: Sequence[str] = ("calculator",),
        max_tool_calls: int = 4,
        instruction: str = "Use the tools for every calculation.",
        sandbox: Mapping[str, Any] | None = None,
        demonstration: Sequence[Mapping[str, str]] = (),
    ):
        limits = SandboxLimits(**dict(sandbox or {}))  # TypeError on an unknown limit: the loader reports it
        available: dict[str, tuple[dict, ToolFn]] = {
            "calculator": (CALCULATOR_TOOL, call_calculator),
            "python": (PYTHON_TOOL, lambda arguments: call_python(arguments, limits)),
        }
        unknown = sorted(set(tools) - set(available))
        if unknown or not tools:
            raise ValueError(f"tools must name some of {sorted(available)}, got {list(tools)}")
        if not isinstance(max_tool_calls, int) or max_tool_calls < 1:
            raise ValueError(f"max_tool_calls must be an integer >= 1, got {max_tool_calls!r}")
        self.tools = tuple(available[name][0] for name in tools)
        self._handlers = {name: available[name][1] for name in tools}
        self.max_tool_calls, self.instruction = max_tool_calls, instruction
        self.demonstration = _chat_messages(demonstration, "demonstration")
        self.record: Mapping[str, Any] = {}

    def reset(self, record: Mapping[str, Any]) -> list[Message]:
        """The record's chat with the tool instruction appended to its last user turn, the
        demonstration (if any) after its leading system messages."""
        self.record = record
        messages = [dict(m) for m in record["messages"]]
        if self.instruction:
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{self.instruction}"
        head = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        return [*messages[:head], *(dict(m) for m in self.demonstration), *messages[head:]]

    def step(self, model_turn: str) -> StepResult:
        """Run the turn's tool calls, or score it as the final answer when it makes none."""
        calls = parse_tool_calls(model_turn)
        if not calls:
            return StepResult(observation=(), done=True, reward=self.score(model_turn))
        outcomes = [self._call(call) for call in calls[: self.max_tool_calls]]
        outcomes += [
            (f"Error: at most {self.max_tool_calls} tool calls per turn; this one was not run", False)
            for _ in calls[self.max_tool_calls :]
        ]
        observation = tuple({"role": "tool", "content": text} for text, _ in outcomes)
        return StepResult(
            observation=observation, done=False, tool_calls=len(calls), tool_errors=sum(not ok for _, ok in outcomes)
        )

    def _call(self, call: ToolCall) -> tuple[str, bool]:
        if call.error is not None:
            return f"Error: malformed tool call ({call.error})", False
        if call.name not in self._handlers:
            return f"Error: no tool named {call.name!r}; the tools are {', '.join(self._handlers)}", False
        return self._handlers[call.name](call.arguments)

    def score(self, final_turn: str) -> float | None:
        """reasoning_gym's scorer on the final turn's last \\boxed{} (None for other sources)."""
        metadata = self.record.get("metadata") or {}
        name, entry = metadata.get("reasoning_gym"), metadata.get("entry")
        if name is None or entry is None:
            return None
        import reasoning_gym

        return float(reasoning_gym.get_score_answer_fn(name)(answer=extract_boxed(final_turn), entry=entry))


class CalculatorArithmetic(ToolTask):
    """A `ToolTask` with the calculator tool."""

    def __init__(
        self,
        *,
        max_tool_calls: int = 4,
        instruction: str = "Use the calculator tool for every calculation.",
        demonstration: Sequence[Mapping[str, str]] = (),
    ):
        super().__init__(
            tools=("calculator",), max_tool_calls=max_tool_calls, instruction=instruction, demonstration=demonstration
        )


class PythonArithmetic(ToolTask):
    """A `ToolTask` with the sandboxed Python tool (``sandbox``: `SandboxLimits` fields)."""

    def __init__(
        self,
        *,
        max_tool_calls: int = 4,
        instruction: str = "Use the python tool for every calculation.",
        sandbox: Mapping[str, Any] | None = None,
        demonstration: Sequence[Mapping[str, str]] = (),
    ):
        super().__init__(
            tools=("python",),
            max_tool_calls=max_tool_calls,
            instruction=instruction,
            sandbox=sandbox,
            demonstration=demonstration,
        )


_ROLES = ("system", "user", "assistant", "tool")


def _chat_messages(messages: Sequence[Mapping[str, str]], name: str) -> tuple[Message, ...]:
    """`messages` as chat message dicts; ValueError naming `name` unless each has a known role
    and a string content."""
    if isinstance(messages, str | Mapping) or not isinstance(messages, Sequence):
        raise ValueError(f"{name} must be a list of chat messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if (
            not isinstance(m, Mapping)
            or m.get("role") not in _ROLES
            or not isinstance(m.get("content"), str)
            or set(m) != {"role", "content"}
        ):
            raise ValueError(f"{name}[{i}] must be {{role: {' | '.join(_ROLES)}, content: <text>}}, got {m!r:.80}")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)
