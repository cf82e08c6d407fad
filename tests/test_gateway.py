"""The agent gateway against a scripted streaming engine, driven by the real ``openai`` client:
tool calls come back in OpenAI's format (parsed from the model's Hermes ``<tool_call>`` text),
a request that extends the session continues on the engine's exact ids + the chat template's
observation ids (checked against ``tokenizer.apply_chat_template`` of the conversation), any
other request starts a recorded branch, streaming (SSE) gives the same turn, logprobs are the
engine's, stop / max_tokens / temperature reach the engine, malformed requests get OpenAI error
JSON and the server keeps serving, and off loopback a key is required."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from megatron_rl.gateway import EngineLink, Gateway, GatewaySettings, Session, TemplateCodec
from megatron_rl.models.synthetic import char_tokenizer
from megatron_rl.rollout.types import GenerationResult, SamplingSettings
from tests.multiturn_fixtures import CHAT_TEMPLATE

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


class ScriptedEngine:
    """Answers turn t of any session with ``script[t]`` (+ the first stop id), log-prob -0.5 - i/100."""

    def __init__(self, tokenizer, script: list[str]) -> None:
        self.tokenizer, self.script, self.requests = tokenizer, script, []

    def generate_stream(self, feed):
        while True:
            feed.handle.poll(0.05)
            taken, closed, aborted = feed.take()
            for req in taken:
                self.requests.append(req)
                turn = int(req.request_id.rsplit("/", 1)[1])
                ids = self.tokenizer.encode(self.script[turn % len(self.script)], add_special_tokens=False)
                ids = (ids + [req.sampling.stop_token_ids[0]])[: req.sampling.max_new_tokens]
                finish = "stop" if ids[-1] in req.sampling.stop_token_ids else "length"
                yield GenerationResult(
                    request_id=req.request_id,
                    prompt_ids=req.prompt_ids,
                    response_ids=tuple(ids),
                    logprobs=tuple(-0.5 - i / 100 for i in range(len(ids))),
                    finish_reason=finish,
                    weight_version=7,
                )
            if aborted or (closed and not taken):
                return


def char_text(tokenizer, ids) -> str:
    return "".join(tokenizer.convert_ids_to_tokens(list(ids), skip_special_tokens=True))


def chat_tokenizer():
    """The char tokenizer with the tiny chat template and the Hermes tags as tokens of their own."""
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    return tokenizer


@pytest.fixture
def served():
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(tokenizer, [f"ok {CALL}", "5"])
    codec = TemplateCodec(tokenizer, decode=lambda ids: char_text(tokenizer, ids))
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=80, stop_token_ids=(tokenizer.eos_token_id,))
    gateway = Gateway(GatewaySettings(), codec=codec, sampling=sampling).start()
    gateway.link = EngineLink(engine)
    session = Session(key="0/p/0", codec=codec, max_total_tokens=2000, seed_of=lambda t: 100 + t)
    sid = gateway.open_session(session)
    client = openai.OpenAI(base_url=gateway.base_url(sid), api_key="unused", max_retries=0)
    yield tokenizer, engine, gateway, session, client
    gateway.link.close()
    gateway.stop()


def test_tool_calls_token_in_token_out_and_branches(served):
    tokenizer, engine, gateway, session, client = served
    messages = [{"role": "user", "content": "add 2 and 3"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, logprobs=True)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "ok"
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert [t.logprob for t in choice.logprobs.content] == list(engine.requests and session.current.logprobs)
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "5" and second.choices[0].finish_reason == "stop"
    b = session.current
    assert len(session.branches) == 1 and b.versions == [7, 7]
    # independent: the template's rendering of the conversation, model turns as their raw text
    convo = [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": f"ok {CALL}"},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    from megatron_rl.environments.template import render_ids

    assert b.context == render_ids(tokenizer, convo, TOOLS, generation=False)
    # engine ids turn by turn, mask 1 on model ids only
    r0, r1 = engine.requests
    assert r1.prompt_ids[: len(r0.prompt_ids)] == r0.prompt_ids and b.prompt_ids == r0.prompt_ids
    model = [i for i, m in zip(b.ids, b.mask, strict=True) if m]
    n0 = len(tokenizer.encode(f"ok {CALL}", add_special_tokens=False)) + 1
    assert len(model) == n0 + 2 and b.mask[:n0] == [1] * n0 and b.mask[-2:] == [1, 1]
    assert (r0.sampling.seed, r1.sampling.seed) == (100, 101)
    # an edited history is a new branch, recorded
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
    assert len(session.branches) == 2 and session.current.prompt_ids == engine.requests[-1].prompt_ids


def test_streaming_and_sampling_fields(served):
    tokenizer, engine, gateway, session, client = served
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,
        stream=True,
        temperature=0.5,
        max_tokens=30,
        stop=["}"],
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    calls = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    req = engine.requests[0]
    assert req.sampling.temperature == 0.5 and req.sampling.max_new_tokens == 30
    assert tokenizer.convert_tokens_to_ids("}") in req.sampling.stop_token_ids
    assert finish == ["length"] and not calls and text == char_text(tokenizer, tokenizer.encode(f"ok {CALL}")[:30])
    assert chunks[-1].usage.completion_tokens == 30


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": [{"role": "user", "content": "x" * 3000}]}, "messages"),
    ],
)
def test_malformed_requests_get_openai_errors_and_the_server_goes_on(served, body, param):
    tokenizer, engine, gateway, session, client = served
    url = f"{client.base_url}chat/completions"
    reply = httpx.post(url, json={"model": "m", **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(url, content=b"{not json").json()["error"]["param"] == "body"
    assert session.malformed == 2
    ok = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert ok.choices[0].message.tool_calls
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(
            base_url=str(client.base_url).replace(gateway.sessions and next(iter(gateway.sessions)), "nope"),
            api_key="k",
        ).models.list()
    assert [m.id for m in client.models.list().data] == ["policy"]


def test_closed_session_and_key_rule():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    with pytest.raises(ValueError, match="agent.key"):
        GatewaySettings(host="0.0.0.0")
    codec = TemplateCodec(tokenizer)
    gateway = Gateway(GatewaySettings(key="s3cret"), codec=codec, sampling=SamplingSettings()).start()
    try:
        sid = gateway.open_session(Session(key="k", codec=codec, max_total_tokens=50, seed_of=lambda t: t))
        url = gateway.base_url(sid)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=url, api_key="s3cret").models.list().data[0].id == "policy"
        gateway.close_session(sid, "timed_out")
        reply = httpx.post(
            f"{url}/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}]},
            headers={"Authorization": "Bearer s3cret"},
        )
        assert reply.status_code == 404 and "error" in reply.json()
    finally:
        gateway.stop()
    assert not threading.current_thread().name.startswith("megatron_rl-gateway")
