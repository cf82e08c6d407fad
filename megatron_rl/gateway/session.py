"""One rollout session of the gateway: the exact token ids the engine sampled, turn by turn.

A session holds branches. A branch is a first prompt (the chat template's rendering of a
request's messages with the generation header, ``template.prompt_ids``) followed by model turns
(the engine's ids as sampled, mask 1, its behaviour log-probs, the weight version) and the
observations between them (mask 0, log-prob 0.0). A request *extends* the current branch when
its messages are the branch's conversation (every earlier request's messages and each
assistant message as the gateway returned it, compared by ``openai_format.canonical``) followed
by one or more non-assistant messages (tool results, user turns), with the same tools: its
prompt is then the branch's ids + ``template.observation_ids`` of those new messages (after the
template's end-of-turn token when the last turn did not sample one: a length cut or a stop
string). Any other request starts a new branch from its own rendering, recorded as such. The
model's text is never re-encoded: a branch's ids are the engine's and the template's.

The session's trajectory is its last branch; ``branches`` counts how many it started.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from megatron_rl.environments.template import end_of_turn_id, observation_ids, parse_tool_calls, prompt_ids
from megatron_rl.gateway.openai_format import ChatRequest, RequestError, canonical


class TemplateCodec:
    """A tokenizer's chat template, token in / token out (``environments.template``)."""

    def __init__(self, tokenizer: Any, decode: Callable[[Sequence[int]], str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.decode = decode or (lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True))
        self._eot = lru_cache(maxsize=16)(lambda tools_json: end_of_turn_id(tokenizer, json.loads(tools_json)))

    def prompt(self, messages: Sequence[dict], tools: Sequence[dict]) -> tuple[int, ...]:
        """The first prompt of ``messages``, generation header included."""
        return prompt_ids(self.tokenizer, _render(messages), list(tools))

    def observation(self, messages: Sequence[dict], tools: Sequence[dict]) -> tuple[int, ...]:
        """The ids the template appends after an ended assistant turn for ``messages``."""
        return observation_ids(self.tokenizer, _render(messages), list(tools))

    def end_of_turn(self, tools: Sequence[dict]) -> int:
        """The token that ends an assistant turn (a stop id of every turn)."""
        return self._eot(json.dumps(list(tools)))

    def token_text(self, token: int) -> str:
        """One token's text (the ``logprobs`` entries)."""
        return self.tokenizer.convert_ids_to_tokens(int(token))


def _render(messages: Sequence[dict]) -> list[dict]:
    """Messages as chat templates read them (tool-call arguments as objects)."""
    return [dict(m) for m in messages]


@dataclass(kw_only=True)
class Branch:
    """A prompt and the turns that followed it (module doc)."""

    prompt_ids: tuple[int, ...]
    tools_key: str
    conversation: list[tuple] = field(default_factory=list)  # canonical messages so far
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # the version that sampled each of ``ids``; an observation carries the version before it
    token_versions: list[int] = field(default_factory=list)
    closed_turn: bool = True  # the last model turn sampled the end-of-turn token
    last_text: str = ""
    finish_reason: str = "stop"
    tool_calls: int = 0
    tool_errors: int = 0

    @property
    def context(self) -> tuple[int, ...]:
        return self.prompt_ids + tuple(self.ids)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The next turn's prompt: on ``branch`` after appending ``observation`` (mask 0)."""

    branch: Branch
    observation: tuple[int, ...]
    new: bool
    messages: tuple[tuple, ...]  # the request's canonical messages

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.branch.context + self.observation


class Session:
    """A trajectory's conversation with the gateway (module doc). Not thread-safe: the gateway
    serializes a session's requests."""

    def __init__(self, *, key: str, codec: TemplateCodec, max_total_tokens: int, seed_of: Callable[[int], int]) -> None:
        self.key, self.codec, self.max_total_tokens, self.seed_of = key, codec, max_total_tokens, seed_of
        self.branches: list[Branch] = []
        self.turns = 0  # model turns asked for, over all branches (turn t's request id is "<key>/<t>")
        self.closed: str | None = None  # why no more requests are taken (timed out, finished)
        self.malformed = 0  # requests refused with an error

    @property
    def current(self) -> Branch | None:
        return self.branches[-1] if self.branches else None

    def plan(self, request: ChatRequest) -> Plan:
        """Where the request's turn goes (module doc); ``RequestError`` when it cannot fit."""
        messages = tuple(canonical(m) for m in request.messages)
        tools_key = json.dumps(request.tools, sort_keys=True)
        branch = self.current
        n = len(branch.conversation) if branch else 0
        extends = (
            branch is not None
            and branch.tools_key == tools_key
            and len(messages) > n
            and messages[:n] == tuple(branch.conversation)
            and all(m[0] != "assistant" for m in messages[n:])
        )
        if extends:
            obs = self.codec.observation(request.messages[n:], request.tools)
            eot = () if branch.closed_turn else (self.codec.end_of_turn(request.tools),)
            plan = Plan(branch=branch, observation=eot + obs, new=False, messages=messages)
        else:
            fresh = Branch(prompt_ids=self.codec.prompt(request.messages, request.tools), tools_key=tools_key)
            plan = Plan(branch=fresh, observation=(), new=True, messages=messages)
        if len(plan.prompt_ids) >= self.max_total_tokens:
            raise RequestError(
                f"the prompt is {len(plan.prompt_ids)} tokens; the session's budget is {self.max_total_tokens}",
                code="context_length_exceeded",
                param="messages",
            )
        return plan

    def room(self, plan: Plan) -> int:
        """Tokens the turn may still sample under the session's budget."""
        return self.max_total_tokens - len(plan.prompt_ids)

    def commit(self, plan: Plan, *, result: Any, text: str, assistant: dict, closed_turn: bool) -> None:
        """Append the observation and the engine's turn (``result``: a ``GenerationResult``)."""
        b = plan.branch
        if plan.new:
            self.branches.append(b)
        before = b.token_versions[-1] if b.token_versions else result.weight_version
        b.token_versions += [before] * len(plan.observation)
        b.token_versions += result.versions_per_token
        b.ids += plan.observation
        b.mask += [0] * len(plan.observation)
        b.logprobs += [0.0] * len(plan.observation)
        b.ids += result.response_ids
        b.mask += [1] * len(result.response_ids)
        b.logprobs += result.logprobs
        b.versions.append(result.weight_version)
        b.conversation = [*plan.messages, canonical(assistant)]
        b.closed_turn, b.last_text, b.finish_reason = closed_turn, text, result.finish_reason
        calls = parse_tool_calls(text)
        b.tool_calls += len(calls)
        b.tool_errors += sum(c.error is not None for c in calls)
