"""Agent rollouts end to end on the ``hf`` engine (tiny chat model): an agent written as plain
``openai`` client code drives multi-turn tool conversations through the gateway
(``AgentGenerator``). Checked against independent computations: each trajectory's ids are the
engine's ids turn by turn (``StreamRecorder``) and equal ``tokenizer.apply_chat_template`` of the
whole conversation; its behaviour log-probs equal a teacher-forced transformers forward; the mask
covers model tokens only. Agents that crash, hang past ``timeout_s`` or return a non-number end
their trajectories as counted failures while the batch completes."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import torch

from megatron_rl.data.records import PromptRecord, TokenizedPrompt
from megatron_rl.environments.template import render_ids
from megatron_rl.gateway import Gateway, GatewaySettings, TemplateCodec
from megatron_rl.generation import AgentGenerator, AgentSettings, BatchRequest, Trajectory
from megatron_rl.rollout import EngineSettings, SamplingSettings, build_engine
from megatron_rl.rollout.engine_wrapper import StreamRecorder
from tests.multiturn_fixtures import make_tiny_chat_model
from tests.rl_fixtures import teacher_forced_logprobs

pytestmark = [pytest.mark.multiproc]

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]
QUESTIONS = {"p0": "What is 3+4?", "p1": "Add 12 and 30."}
G, TURNS = 3, 3


def tool_agent(task, base_url):
    """A multi-turn tool agent in plain openai client code: a tool result after every turn."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(task["messages"])
    for turn in range(TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=8)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        if turn < TURNS - 1:
            messages.append({"role": "tool", "tool_call_id": "c", "content": f"= {turn}"})
    return float(len(task["question"]))


def failing_agent(task, base_url):
    """One model turn, then p0's agents raise, p1's hang past the timeout, p2's return a string."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    client.chat.completions.create(model="policy", messages=task["messages"], max_tokens=4)
    if task["prompt_id"] == "p0":
        raise RuntimeError("agent crashed")
    if task["prompt_id"] == "p1":
        time.sleep(60.0)
    return "not a reward"


def char_text(tokenizer, ids) -> str:
    return "".join(tokenizer.convert_ids_to_tokens(list(ids), skip_special_tokens=True))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    path = make_tiny_chat_model(tmp_path_factory.mktemp("agent") / "chat")
    engine = build_engine(EngineSettings(dtype="float32", engine="hf", model_path=str(path), max_batch_size=8))
    tokenizer = AutoTokenizer.from_pretrained(path)
    codec = TemplateCodec(tokenizer, decode=lambda ids: char_text(tokenizer, ids))
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=8, stop_token_ids=(tokenizer.eos_token_id,))
    gateway = Gateway(GatewaySettings(), codec=codec, sampling=sampling).start()
    yield path, tokenizer, StreamRecorder(engine), gateway
    gateway.stop()
    engine.shutdown()


def batch(prompt_ids, *questions) -> BatchRequest:
    items = tuple(
        TokenizedPrompt(record=PromptRecord(prompt_id=pid, answer="7", text=QUESTIONS.get(pid, "hi")), token_ids=(1,))
        for pid in questions
    )
    return BatchRequest(step=0, items=items, group_size=G, base_seed=11)


def rollout(gateway, engine, fn, *pids, timeout_s=60.0):
    gen = AgentGenerator(
        settings=AgentSettings(run=fn, workers=4, timeout_s=timeout_s, max_total_tokens=1500), gateway=gateway
    )
    seen = []
    out = list(gen.run(engine, batch(None, *pids), stop=threading.Event(), check_version=lambda r, v: seen.append(r)))
    return gen, out, seen


def test_agent_trajectories_are_the_engines_tokens_and_the_templates_rendering(setup):
    path, tokenizer, engine, gateway = setup
    gen, out, seen = rollout(gateway, engine, tool_agent, "p0", "p1")
    assert all(isinstance(t, Trajectory) for t in out) and len(out) == 2 * G
    assert sorted(seen) == sorted(f"0/{p}/{k}/{t}" for p in QUESTIONS for k in range(G) for t in range(TURNS))
    eos, rendered_checked, pairs = tokenizer.eos_token_id, 0, []
    for t in out:
        turns = [engine.results[f"{t.request_id}/{i}"] for i in range(t.turns)]
        assert t.turns == TURNS and t.reward == float(len(QUESTIONS[t.request_id.split("/")[1]]))
        full, mask = t.prompt_ids + t.response_ids, (0,) * len(t.prompt_ids) + t.loss_mask
        at = 0
        for turn in turns:  # each turn's prompt is everything so far; its ids follow verbatim, mask 1
            at = len(turn.prompt_ids)
            assert full[:at] == turn.prompt_ids and full[at : at + len(turn.response_ids)] == turn.response_ids
            assert mask[at : at + len(turn.response_ids)] == (1,) * len(turn.response_ids)
            assert t.behav_logprobs[at - len(t.prompt_ids) :][: len(turn.response_ids)] == turn.logprobs
        assert sum(t.loss_mask) == sum(len(r.response_ids) for r in turns) and at + len(turns[-1].response_ids) == len(
            full
        )
        specials = {tokenizer.pad_token_id, tokenizer.unk_token_id, eos}
        if all(set(r.response_ids[:-1]).isdisjoint(specials) for r in turns):
            convo = [{"role": "user", "content": QUESTIONS[t.request_id.split("/")[1]]}]
            for i, r in enumerate(turns):
                convo.append({"role": "assistant", "content": char_text(tokenizer, r.response_ids)})
                if i < TURNS - 1:
                    convo.append({"role": "tool", "content": f"= {i}"})
            expect = render_ids(tokenizer, convo, TOOLS, generation=False)  # apply_chat_template
            assert full == expect[: len(full)] and len(expect) - len(full) <= 1
            rendered_checked += 1
        pairs.append((t.prompt_ids, t.response_ids))
    assert rendered_checked >= 2
    for forced, t in zip(teacher_forced_logprobs(path, pairs), out, strict=True):
        got = torch.tensor([lp for lp, m in zip(t.behav_logprobs, t.loss_mask, strict=True) if m])
        want = torch.tensor([lp for lp, m in zip(forced, t.loss_mask, strict=True) if m], dtype=torch.float32)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    assert gen.stats.trajectories == 2 * G and gen.stats.crashed == gen.stats.timed_out == 0


def test_crashed_hung_and_malformed_agents_are_counted_failures(setup):
    path, tokenizer, engine, gateway = setup
    start = time.monotonic()
    gen, out, _ = rollout(gateway, engine, failing_agent, "p0", "p1", "p2", timeout_s=20.0)
    assert time.monotonic() - start < 60
    assert len(out) == 3 * G and all(isinstance(t, Trajectory) and t.env_failures == 1 for t in out)
    assert all(t.reward is None and t.turns == 1 for t in out)  # scored by the task reward
    s = gen.stats
    assert (s.crashed, s.timed_out, s.bad_return, s.trajectories) == (G, G, G, 3 * G)
    assert not gateway.sessions  # every session closed
