"""The gateway's streaming and ``stop`` strings, driven by the real ``openai`` client against a
scripted engine (``tests.test_gateway``): a ``stream: true`` turn arrives as one chunk per
token's piece of text, each with that token's log-prob, and the pieces join to the
non-streamed content; a ``stop`` string of several tokens cuts the turn's ids, log-probs and
text at the same place (the ids the session trains decode to exactly what the client was
shown, checked against the chat template's rendering of the conversation), finish_reason
"stop". ``detok`` on SmolLM2's byte-level tokenizer: pieces of multi-byte text join to the
decode, and a stop string is cut on the token boundary before it."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from megatron_rl.environments.template import render_ids
from megatron_rl.gateway import EngineLink, Gateway, GatewaySettings, Session, TemplateCodec
from megatron_rl.gateway.detok import pieces, stop_cut
from megatron_rl.rollout.types import SamplingSettings
from tests.test_gateway import ScriptedEngine, char_text, chat_tokenizer

SMOLLM2 = Path(__file__).resolve().parents[1] / ".cache/models/smollm2-135m-instruct"


@contextmanager
def serving(script: list[str]):
    tokenizer = chat_tokenizer()
    engine = ScriptedEngine(tokenizer, script)
    codec = TemplateCodec(tokenizer, decode=lambda ids: char_text(tokenizer, ids))
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=80, stop_token_ids=(tokenizer.eos_token_id,))
    gateway = Gateway(GatewaySettings(), codec=codec, sampling=sampling).start()
    gateway.link = EngineLink(engine)
    session = Session(key="0/p/0", codec=codec, max_total_tokens=2000, seed_of=lambda t: t)
    client = openai.OpenAI(base_url=gateway.base_url(gateway.open_session(session)), api_key="-", max_retries=0)
    try:
        yield tokenizer, engine, session, client
    finally:
        gateway.link.close()
        gateway.stop()


def test_streaming_sends_a_chunk_per_token_with_its_logprob():
    with serving(["hello 5"]) as (tokenizer, engine, session, client):
        messages = [{"role": "user", "content": "hi"}]
        whole = client.chat.completions.create(model="m", messages=messages, logprobs=True)
        chunks = list(client.chat.completions.create(model="m", messages=messages, logprobs=True, stream=True))
    content = [c.choices[0] for c in chunks if c.choices and c.choices[0].delta.content]
    assert [c.delta.content for c in content] == list("hello 5")  # the char tokenizer: a token per char
    assert "".join(c.delta.content for c in content) == whole.choices[0].message.content == "hello 5"
    streamed = [lp.logprob for c in content for lp in c.logprobs.content]
    assert streamed == [lp.logprob for lp in whole.choices[0].logprobs.content]  # the stop token's with the last
    assert [len(c.logprobs.content) for c in content] == [1] * 6 + [2]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len(engine.requests) == 2 and all(r.sampling.max_new_tokens == 80 for r in engine.requests)


def test_a_multi_token_stop_string_cuts_ids_logprobs_and_text_alike():
    with serving(["7 DONE and more", "8"]) as (tokenizer, engine, session, client):
        messages = [{"role": "user", "content": "add"}]
        first = client.chat.completions.create(model="m", messages=messages, stop=["NEVER", "DONE"], logprobs=True)
        choice = first.choices[0]
        assert choice.message.content == "7 " and choice.finish_reason == "stop"
        assert [lp.token for lp in choice.logprobs.content] == ["7", " "]
        stop_ids = engine.requests[0].sampling.stop_token_ids
        assert not set(stop_ids) & set(tokenizer.encode("DONE", add_special_tokens=False))  # found in the text
        b = session.current
        model = [i for i, m in zip(b.ids, b.mask, strict=True) if m]
        assert char_text(tokenizer, model) == "7 " and b.logprobs == [-0.5, -0.51]  # what the client saw
        messages += [choice.message.model_dump(exclude_none=True), {"role": "tool", "content": "= 7"}]
        second = client.chat.completions.create(model="m", messages=messages, stop="DONE")
        assert second.choices[0].message.content == "8" and len(session.branches) == 1
    # independent: the template's rendering of the conversation as the client saw it
    convo = [*messages[:1], {"role": "assistant", "content": "7 "}, messages[2], {"role": "assistant", "content": "8"}]
    assert session.current.context == render_ids(tokenizer, convo, [], generation=False)


@pytest.mark.skipif(not SMOLLM2.exists(), reason="needs .cache/models/smollm2-135m-instruct")
def test_detok_on_a_byte_level_tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)

    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    text = "Grüße, 東京 🙂! The answer is 42.\nObservation: none"
    ids = tokenizer.encode(text, add_special_tokens=False)
    got = pieces(ids, decode)
    assert len(got) == len(ids) and "".join(got) == text and "" in got  # the emoji spans tokens
    keep = stop_cut(ids, ["\nObservation:", "zzz"], decode)
    assert decode(ids[:keep]) == "Grüße, 東京 🙂! The answer is 42."
    assert "\nObservation:"[0] in decode(ids[keep : keep + 1])
    assert stop_cut(ids, ["zzz"], decode) is None and stop_cut(ids, ["Gr"], decode) == 0
