"""Token in / token out through the model's chat template, and the tool-call format.

Contract:
- `prompt_ids(tokenizer, messages, tools)`: the first prompt, rendered by the tokenizer's chat
  template with the tools and the generation header (``apply_chat_template(...,
  add_generation_prompt=True, tokenize=True)``).
- `observation_ids(tokenizer, messages, tools)`: the exact ids the chat template appends after
  an assistant turn that ended with its end-of-turn token (`end_of_turn_id`, the engine's stop
  token, kept in the model's ids) for these observation messages, up to and including the next
  assistant generation header. Found as verl / slime do, by rendering a fixed dummy conversation
  with and without the observations and taking the token suffix; `TemplateError` when the
  template is not prefix-stable (the prompt is not a prefix of the longer rendering, or it does
  not end with the generation header). The model's own ids are never decoded and re-encoded:
  a trajectory is ``prompt_ids + model ids + observation_ids + model ids + ...``, which equals
  the template's rendering of the whole conversation.
- Templates that ignore ``tools`` (SmolLM2-135M's) get the tool list as a Hermes-style block in
  the system message (`tool_system_prompt`), the format Qwen2.5's template writes.
- `parse_tool_calls(text)`: the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (Qwen / Hermes) blocks of a model turn; a block that is not such JSON (or not closed) is a
  `ToolCall` with `error` set.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.environments.base import Message

_HEAD: tuple[Message, ...] = ({"role": "user", "content": "U"},)  # the fixed dummy conversation
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe", "description": "d", "parameters": {"type": "object", "properties": {}}},
}
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.S)


class TemplateError(ValueError):
    """The chat template cannot be used token in / token out."""


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One tool call parsed from a model turn."""

    name: str  # "" when the block could not be parsed
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the block is not a valid call


def render_ids(
    tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict], *, generation: bool
) -> tuple[int, ...]:
    """The chat template's token ids for `messages` (tools placed as the template wants)."""
    messages, tools = with_tools(tokenizer, messages, tools)
    out = tokenizer.apply_chat_template(
        list(messages), tools=list(tools) or None, tokenize=True, add_generation_prompt=generation, return_dict=True
    )
    return tuple(int(i) for i in out["input_ids"])


def prompt_ids(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict]) -> tuple[int, ...]:
    """The first prompt's ids, generation header included."""
    return render_ids(tokenizer, messages, tools, generation=True)


def observation_ids(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict]) -> tuple[int, ...]:
    """The ids the template appends after an assistant turn's end-of-turn token for `messages`,
    through the next assistant generation header (see module doc)."""
    if not messages:
        raise ValueError("observation_ids needs at least one observation message")
    return _after_assistant(tokenizer, tuple(messages), tuple(tools))[1:]


def end_of_turn_id(tokenizer: Any, tools: Sequence[dict] = ()) -> int:
    """The token that closes an assistant turn in this template (the model's stop token)."""
    return _after_assistant(tokenizer, ({"role": "user", "content": "V"},), tuple(tools))[0]


def _after_assistant(tokenizer: Any, observation: tuple[Message, ...], tools: tuple[dict, ...]) -> tuple[int, ...]:
    """Ids from the token closing a dummy assistant turn through `observation` and the next
    generation header; TemplateError if the template is not prefix-stable."""
    prompt, header = _head(tokenizer, tokenizer.chat_template, json.dumps(tools))  # key order kept: it is rendered
    full, other = (
        render_text(tokenizer, [*_HEAD, {"role": "assistant", "content": text}, *observation], tools, generation=True)
        for text in ("A", "B")
    )
    if not full.startswith(prompt):
        raise TemplateError(
            "chat template is not prefix-stable: the prompt rendered with the generation "
            "header is not a prefix of the conversation continued by an assistant turn"
        )
    if not header or not full.endswith(header):
        raise TemplateError(
            f"chat template does not end the observation {list(observation)!r:.200} with the "
            f"assistant generation header {header!r} it puts after a prompt"
        )
    tail = full[len(full) - _common_suffix(full, other) :]  # text after the assistant's content
    ids = tuple(tokenizer(tail, add_special_tokens=False)["input_ids"])
    in_context = tuple(tokenizer(full, add_special_tokens=False)["input_ids"])
    if len(ids) < 2 or in_context[-len(ids) :] != ids or ids[0] not in special_ids(tokenizer):
        raise TemplateError(
            f"chat template: the text after an assistant turn ({tail!r:.200}) does not start with "
            "one end-of-turn token or tokenizes differently in context"
        )
    return ids


@functools.lru_cache(maxsize=16)
def _head(tokenizer: Any, template: str, tools_json: str) -> tuple[str, str]:
    """(the dummy prompt with its generation header, that header) for this template and tools."""
    tools = json.loads(tools_json)
    prompt = render_text(tokenizer, _HEAD, tools, generation=True)
    return prompt, prompt[len(render_text(tokenizer, _HEAD, tools, generation=False)) :]


def special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokenizer's special and added tokens (an end-of-turn token is one)."""
    return frozenset(tokenizer.all_special_ids) | frozenset(getattr(tokenizer, "added_tokens_decoder", {}))


def render_text(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict], *, generation: bool) -> str:
    """The chat template's text for `messages` (tools placed as the template wants)."""
    messages, tools = with_tools(tokenizer, messages, tools)
    return tokenizer.apply_chat_template(
        list(messages), tools=list(tools) or None, tokenize=False, add_generation_prompt=generation
    )


def _common_suffix(a: Sequence, b: Sequence) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def with_tools(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict]) -> tuple[list[Message], list[dict]]:
    """(messages, tools) to render: unchanged when the template renders tools, else the tools
    moved into the system message as a Hermes-style block."""
    if not tools or renders_tools(tokenizer):
        return list(messages), list(tools)
    block = tool_system_prompt(tools)
    if messages and messages[0].get("role") == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}
        return [first, *messages[1:]], []
    return [{"role": "system", "content": block}, *messages], []


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes the tool list it is given."""
    return _renders_tools(tokenizer.chat_template, tokenizer)


@functools.lru_cache(maxsize=8)
def _renders_tools(template: str, tokenizer: Any) -> bool:
    msgs = [{"role": "user", "content": "U"}]
    plain = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return plain != tokenizer.apply_chat_template(msgs, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True)


def tool_system_prompt(tools: Sequence[dict]) -> str:
    """The Hermes / Qwen2.5 tool block: the schemas in <tools></tools> and the call format."""
    schemas = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{schemas}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of a model turn, in order (see module doc)."""
    return [_parse_call(body, closed=bool(end)) for body, end in _TOOL_CALL.findall(text)]


def _parse_call(body: str, *, closed: bool) -> ToolCall:
    if not closed:
        return ToolCall(name="", error="<tool_call> not closed by </tool_call>")
    try:
        call = json.loads(body, strict=False)  # raw newlines inside strings (code) are common
    except json.JSONDecodeError as err:
        return ToolCall(name="", error=f"not valid JSON: {err}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(name="", error='expected {"name": "...", "arguments": {...}}')
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: the arguments as a JSON string
        try:
            args = json.loads(args, strict=False)
        except json.JSONDecodeError as err:
            return ToolCall(name=call["name"], error=f"arguments are not valid JSON: {err}")
    if not isinstance(args, dict):
        return ToolCall(name=call["name"], error="arguments must be a JSON object")
    return ToolCall(name=call["name"], arguments=args)
