"""OpenAI chat-completions wire format: a request's body checked into a ``ChatRequest``, the
answer as a completion object or as server-sent-event chunks, OpenAI-style error bodies, and the
canonical form of a message that decides whether a request extends a session's conversation.

Contract:
- ``parse_request(body)`` returns a ``ChatRequest`` or raises ``RequestError`` (HTTP status,
  message naming the field, OpenAI error type / code): never anything else for any JSON body.
- ``canonical(message)``: (role, text, tool calls as (name, arguments sorted as JSON)): two
  messages with the same canonical form render the same; an assistant message sent back as
  the gateway returned it has the canonical form the gateway recorded.
- Tool calls come from the model's text (``environments.template.parse_tool_calls``, the
  Hermes / Qwen ``<tool_call>`` blocks); a turn with calls has ``finish_reason`` "tool_calls"
  and its text outside the blocks as ``content`` (None when empty).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl.environments.template import parse_tool_calls

ROLES = ("system", "user", "assistant", "tool")
_BLOCK = re.compile(r"<tool_call>.*?(</tool_call>|\Z)", re.S)


class RequestError(ValueError):
    """A request the gateway refuses: ``status`` and an OpenAI-style error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """The fields of ``/v1/chat/completions`` the gateway honours."""

    model: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...]
    tool_choice: Any  # "auto" / "none" / "required" / a named function; the template decides
    temperature: float | None
    max_tokens: int | None
    stop: tuple[str, ...]
    logprobs: bool
    stream: bool
    include_usage: bool


def _need(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise RequestError(message, param=param)


def parse_request(body: Any) -> ChatRequest:
    """The ``ChatRequest`` of a decoded JSON body; ``RequestError`` naming the bad field."""
    _need(isinstance(body, dict), "the request body must be a JSON object", "body")
    messages = body.get("messages")
    _need(isinstance(messages, list) and bool(messages), "'messages' must be a non-empty list", "messages")
    msgs = tuple(_message(m, i) for i, m in enumerate(messages))
    tools = body.get("tools") or []
    _need(isinstance(tools, list) and all(isinstance(t, dict) for t in tools), "'tools' must be a list", "tools")
    temperature = body.get("temperature")
    _need(temperature is None or _number(temperature, 0, 2), "'temperature' must be in [0, 2]", "temperature")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    ok_max = max_tokens is None or (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0)
    _need(ok_max, "'max_tokens' must be a positive integer", "max_tokens")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    ok_stop = isinstance(stop, list | tuple) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)
    _need(ok_stop, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    _need(body.get("n", 1) == 1, "'n' must be 1 (one sample per request)", "n")
    _need(not body.get("top_logprobs"), "'top_logprobs' is not supported (sampled tokens only)", "top_logprobs")
    options = body.get("stream_options") or {}
    _need(isinstance(options, dict), "'stream_options' must be an object", "stream_options")
    return ChatRequest(
        model=str(body.get("model", "")),
        messages=msgs,
        tools=tuple(tools),
        tool_choice=body.get("tool_choice", "auto"),
        temperature=None if temperature is None else float(temperature),
        max_tokens=max_tokens,
        stop=tuple(stop),
        logprobs=bool(body.get("logprobs", False)),
        stream=bool(body.get("stream", False)),
        include_usage=bool(options.get("include_usage", False)),
    )


def _number(value: Any, low: float, high: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high


def _message(m: Any, i: int) -> dict[str, Any]:
    """One message, its content flattened to text (text parts only)."""
    where = f"messages[{i}]"
    _need(isinstance(m, dict) and m.get("role") in ROLES, f"{where}: role must be one of {ROLES}", where)
    content = m.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        _need(all(isinstance(t, str) for t in texts) and len(texts) == len(content), f"{where}: text parts only", where)
        content = "".join(texts)
    _need(content is None or isinstance(content, str), f"{where}.content must be a string", where)
    out = {"role": m["role"], "content": content or ""}
    calls = m.get("tool_calls")
    if calls:
        _need(m["role"] == "assistant" and isinstance(calls, list), f"{where}.tool_calls: assistant only", where)
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if m["role"] == "tool" and "tool_call_id" in m:
        out["tool_call_id"] = str(m["tool_call_id"])
    return out


def _call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    _need(isinstance(fn, dict) and isinstance(fn.get("name"), str), f"{where}: needs function.name", where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError as err:
            raise RequestError(f"{where}: arguments are not JSON: {err}", param=where) from err
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


def canonical(message: Mapping[str, Any]) -> tuple:
    """What decides whether two messages are the same turn (module doc)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in message.get("tool_calls") or ()
    )
    return (message["role"], message.get("content") or "", calls)


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One model turn as the API shows it."""

    text: str  # the turn's decoded text (stop token and stop string excluded)
    content: str | None
    tool_calls: tuple[dict[str, Any], ...]  # OpenAI format, arguments as JSON strings
    finish_reason: str  # "stop" / "length" / "tool_calls"
    tokens: tuple[str, ...]  # each sampled token's text (for logprobs)
    logprobs: tuple[float, ...]
    prompt_tokens: int
    pieces: tuple[str, ...] = ()  # what each token adds to ``text`` (``detok.pieces``; streaming only)


def assistant_turn(text: str, *, turn_id: str, cut: bool) -> tuple[str | None, tuple[dict[str, Any], ...], str]:
    """(content, tool_calls, finish_reason) of a model turn's text; ``cut``: ended by a length limit."""
    calls = [c for c in parse_tool_calls(text) if c.error is None]
    tool_calls = tuple(
        {
            "id": f"call_{turn_id}_{j}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for j, c in enumerate(calls)
    )
    content = _BLOCK.sub("", text).strip() if tool_calls else text
    finish = "length" if cut else "tool_calls" if tool_calls else "stop"
    return content or None, tool_calls, finish


def recorded_message(turn: Turn) -> dict[str, Any]:
    """The assistant message the gateway returned, in the form ``canonical`` reads."""
    calls = [
        {
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
        }
        for c in turn.tool_calls
    ]
    return {"role": "assistant", "content": turn.content or "", **({"tool_calls": calls} if calls else {})}


def completion(turn: Turn, *, cid: str, model: str, logprobs: bool) -> dict[str, Any]:
    """The ``chat.completion`` object of one turn."""
    message = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = list(turn.tool_calls)
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": turn.finish_reason, "logprobs": _logprobs(turn, logprobs)}
        ],
        "usage": _usage(turn),
    }


def _usage(turn: Turn) -> dict[str, int]:
    n = len(turn.tokens)
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": n, "total_tokens": turn.prompt_tokens + n}


def _logprobs(turn: Turn, wanted: bool, covered: range | None = None) -> dict[str, Any] | None:
    if not wanted:
        return None
    covered = range(len(turn.tokens)) if covered is None else covered
    return {
        "content": [
            {
                "token": turn.tokens[i],
                "logprob": turn.logprobs[i],
                "bytes": list(turn.tokens[i].encode()),
                "top_logprobs": [],
            }
            for i in covered
        ]
    }


def content_deltas(turn: Turn) -> list[tuple[str, range]]:
    """The turn's content as (text, tokens it covers) per stream chunk: one chunk per token's
    piece of text (tokens that add none ride with the next; the stop token with the last), or
    the whole content at once for a turn with tool calls (its content is the text around them)."""
    n = len(turn.tokens)
    if not turn.content:
        return []
    if turn.tool_calls or not turn.pieces or turn.content != turn.text:
        return [(turn.content, range(n))]
    out, start = [], 0
    for i, piece in enumerate(turn.pieces):
        if piece:
            out.append((piece, range(start, i + 1)))
            start = i + 1
    out[-1] = (out[-1][0], range(out[-1][1].start, n))
    return out


def sse_chunks(turn: Turn, *, cid: str, model: str, request: ChatRequest) -> Iterator[str]:
    """The turn as ``chat.completion.chunk`` events (role, content piece by piece, tool calls,
    finish, [usage]), then ``[DONE]``. Sent once the engine answered the whole turn: the engine
    pool streams finished turns, not tokens."""
    head = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, **extra}
        return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

    yield event({"role": "assistant", "content": ""})
    for text, covered in content_deltas(turn):
        yield event({"content": text}, logprobs=_logprobs(turn, request.logprobs, covered))
    if turn.tool_calls:
        yield event({"tool_calls": [{"index": j, **c} for j, c in enumerate(turn.tool_calls)]})
    yield event({}, turn.finish_reason)
    if request.include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(turn)})}\n\n"
    yield "data: [DONE]\n\n"


def stop_ids(tokenizer: Any, stops: Sequence[str]) -> tuple[int, ...]:
    """The token id of each one-token stop string: the engine stops on those at once (longer
    ones are found in the turn's text afterwards: ``detok.stop_cut``)."""
    encoded = [tokenizer.encode(text, add_special_tokens=False) for text in stops]
    return tuple(int(ids[0]) for ids in encoded if len(ids) == 1)
