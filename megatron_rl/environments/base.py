"""The environment contract: what a multi-turn rollout asks of a task with tools.

Contract:
- An `Environment` serves ONE trajectory (state is per trajectory); the run builds a fresh one
  per trajectory from an `EnvironmentFactory` (`load_environment`).
- `reset(record)` returns the first messages (chat messages as transformers chat templates take
  them) for a dataset record, as a `Mapping` (`record_fields` makes it from a `PromptRecord`).
  It must depend on the record only (not on randomness): the K trajectories of a group share
  their first prompt (shared-prompt attention).
- `step(model_turn)` takes the model's decoded turn (its text; the trainer keeps the engine's
  token ids, never re-encodes this text) and returns a `StepResult`: the messages appended
  after the turn (role "tool" or "user"), whether the trajectory is over, and the counts.
- `tools` are JSON schemas in the OpenAI function format, rendered by the chat template
  (`template.py`); an environment without tools has ``tools = ()``.
- Calls may run in a worker thread (`runner.py`): no signals, no global state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from megatron_rl.data.records import PromptRecord

Message = dict[str, Any]  # a chat message as transformers chat templates take it: {"role": ..., "content": ...}


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What an environment answers to one model turn."""

    # messages appended after the model's turn (role "tool" or "user"); may be empty when done
    observation: tuple[Message, ...]
    done: bool
    reward: float | None = None  # final/terminal reward contribution (None: the task reward function scores)
    tool_calls: int = 0  # tool calls parsed from this model turn
    tool_errors: int = 0  # of which failed (bad call, timeout, sandbox kill)
    error: str | None = None  # set by the runner when the environment itself raised or hung


@runtime_checkable
class Environment(Protocol):
    """One trajectory's environment (see module doc)."""

    tools: tuple[dict, ...]  # JSON schemas of the tools (OpenAI function format), rendered by the chat template

    def reset(self, record: Mapping[str, Any]) -> list[Message]:
        """The first messages for this dataset record."""
        ...

    def step(self, model_turn: str) -> StepResult:
        """The environment's answer to the model's decoded turn text."""
        ...


EnvironmentFactory = Callable[[], Environment]  # one fresh Environment per trajectory


def record_fields(record: PromptRecord, *, instruction: str | None = None) -> dict[str, Any]:
    """The mapping `Environment.reset` receives for a `PromptRecord`: ``prompt_id``, ``answer``,
    ``question`` (the last user turn's text, no instruction), ``messages`` (the record's chat as
    message dicts, `instruction` appended to the last user turn as data.instruction does) and
    ``metadata`` (e.g. the reasoning_gym entry)."""
    chat = [{"role": m.role, "content": m.content} for m in record.chat()]
    question = chat[-1]["content"]
    if instruction:
        chat[-1] = {"role": "user", "content": f"{question}\n\n{instruction}"}
    return {
        "prompt_id": record.prompt_id,
        "answer": record.answer,
        "question": question,
        "messages": chat,
        "metadata": record.metadata,
    }
