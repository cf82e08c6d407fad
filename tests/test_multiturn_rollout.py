"""Multi-turn rollouts on the ``hf`` engine (tiny chat model, ``echo`` environment): token in /
token out byte for byte against the chat template's own rendering of each whole conversation,
the loss mask and behaviour log-probs against the engine's turns, the engine's re-prefill
against a teacher-forced transformers forward, budgets, environments that raise or hang, and a
failed reset through the pipeline (its group dropped, the batch complete; past
environment.max_failures the run stops)."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
import torch

from megatron_rl.environments import load_environment
from megatron_rl.environments.tasks import EchoCounter
from megatron_rl.environments.template import observation_ids, prompt_ids
from megatron_rl.generation import GroupStart, MultiTurnGenerator, MultiTurnSettings
from megatron_rl.rollout import EngineSettings, SamplingSettings, build_engine
from megatron_rl.rollout.engine_wrapper import EngineWrapper, StreamRecorder
from tests.multiturn_fixtures import make_tiny_chat_model
from tests.rl_fixtures import teacher_forced_logprobs

pytestmark = [pytest.mark.multiproc]

QUESTIONS = ("What is 3+4?", "Add 12 and 30.")
G, MAX_NEW, BUDGET = 3, 8, 70


class Flaky(EchoCounter):
    """Trajectory 0 of each group raises at its first step, trajectory 1 hangs; the rest echo."""

    made = 0

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.which, Flaky.made = Flaky.made % G, Flaky.made + 1

    def step(self, model_turn: str):
        if self.which == 0:
            raise RuntimeError("tool crashed")
        if self.which == 1:
            time.sleep(3.0)
        return super().step(model_turn)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    path = make_tiny_chat_model(tmp_path_factory.mktemp("multiturn") / "chat")
    engine = build_engine(EngineSettings(dtype="float32", engine="hf", model_path=str(path), max_batch_size=8))
    yield path, AutoTokenizer.from_pretrained(path), engine
    engine.shutdown()


def rollout(tokenizer, engine, factory, runner):
    settings = MultiTurnSettings(
        max_turns=3,
        max_total_tokens=BUDGET,
        encode_prompt=partial(prompt_ids, tokenizer),
        encode_observation=partial(observation_ids, tokenizer),
        decode=partial(char_text, tokenizer),
    )
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=MAX_NEW, stop_token_ids=(tokenizer.eos_token_id,))
    starts = [
        GroupStart(
            base=f"0/p{p}",
            fields={"messages": [{"role": "user", "content": q}]},
            seed=lambda k, t, p=p: 1000 * p + 10 * k + t,
        )
        for p, q in enumerate(QUESTIONS)
    ]
    versions = []
    multi = MultiTurnGenerator(settings=settings, env_factory=factory, runner=runner, sampling=sampling)
    out = list(
        multi.run_groups(engine, starts, G, stop=threading.Event(), check_version=lambda rid, v: versions.append(v))
    )
    return out, versions


def char_text(tokenizer, ids) -> str:
    """The text of char-tokenizer ids (its ``decode`` puts a space between tokens)."""
    return "".join(tokenizer.convert_ids_to_tokens(list(ids), skip_special_tokens=True))


def conversation(question: str, turn_texts: list[str]) -> list[dict]:
    """The whole conversation as messages, observations from a fresh echo environment."""
    env, messages = EchoCounter(turns=3), [{"role": "user", "content": question}]
    for text in turn_texts:
        messages.append({"role": "assistant", "content": text})
        messages.extend(env.step(text).observation)
    return messages


def test_token_in_token_out_mask_logprobs_and_budget(setup):
    from megatron_rl.environments.runner import EnvironmentRunner

    path, tokenizer, pool = setup
    engine, eos = StreamRecorder(pool), tokenizer.eos_token_id
    with EnvironmentRunner(timeout_s=30.0, max_failures=None) as runner:
        trajectories, versions = rollout(tokenizer, engine, load_environment("echo", turns=3), runner)
    assert sorted(t.request_id for t in trajectories) == sorted(f"0/p{p}/{k}" for p in range(2) for k in range(G))
    assert set(versions) == {0} and len(versions) == len(engine.results)
    full_checked, pairs, behav = 0, [], []
    for t in trajectories:
        turns = [engine.results[f"{t.request_id}/{i}"] for i in range(t.turns)]
        ids, mask = list(t.prompt_ids), []
        for turn in turns:
            assert turn.prompt_ids == tuple(ids)  # each turn's prompt: everything so far, as ids
            start = len(ids) - len(t.prompt_ids)
            assert t.response_ids[start : start + len(turn.response_ids)] == turn.response_ids
            assert t.behav_logprobs[start : start + len(turn.response_ids)] == turn.logprobs
            ids += turn.response_ids
            mask += [1] * len(turn.response_ids)
            obs_end = next(
                (i for i in range(len(ids) - len(t.prompt_ids), len(t.response_ids)) if t.loss_mask[i]),
                len(t.response_ids),
            )
            ids += t.response_ids[len(ids) - len(t.prompt_ids) : obs_end]
            mask += [0] * (len(ids) - len(t.prompt_ids) - len(mask))
        assert tuple(ids) == t.prompt_ids + t.response_ids and tuple(mask) == t.loss_mask
        assert len(ids) <= BUDGET and t.loss_mask[-1] == 1  # within budget, ends on a model token
        assert t.truncated or t.turns == 3  # echo(turns=3) ends a trajectory after its third turn
        assert t.truncated or turns[-1].finish_reason == "stop"
        specials = {tokenizer.pad_token_id, tokenizer.unk_token_id, eos}
        if turns[-1].response_ids[-1] == eos and all(set(r.response_ids[:-1]).isdisjoint(specials) for r in turns):
            texts = [char_text(tokenizer, r.response_ids) for r in turns]
            messages = conversation(QUESTIONS[int(t.request_id.split("/")[1][1:])], texts)
            rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
            expect = tuple(rendered["input_ids"])
            assert t.prompt_ids + t.response_ids == expect[: len(t.prompt_ids) + len(t.response_ids)]
            full_checked += 1
        pairs.append((t.prompt_ids, t.response_ids))
        behav.append((t.loss_mask, t.behav_logprobs))
    assert full_checked >= 1 and max(t.turns for t in trajectories) >= 2
    # the engine's log-probs of later turns (a re-prefill of prompt + earlier turns + observations)
    # equal a teacher-forced transformers forward over the whole trajectory
    for forced, (mask, logprobs) in zip(teacher_forced_logprobs(path, pairs), behav, strict=True):
        got = torch.tensor([lp for lp, m in zip(logprobs, mask, strict=True) if m])
        want = torch.tensor([lp for lp, m in zip(forced, mask, strict=True) if m], dtype=torch.float32)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-4)


def test_environment_that_raises_or_hangs_ends_its_trajectory_only(setup):
    from megatron_rl.environments.runner import EnvironmentRunner

    _, tokenizer, engine = setup
    Flaky.made = 0
    with EnvironmentRunner(timeout_s=0.5, max_failures=None) as runner:
        trajectories, _ = rollout(tokenizer, engine, partial(Flaky, turns=3), runner)
    by_k = {k: [t for t in trajectories if t.k == k] for k in range(G)}
    talked = [t for t in trajectories if t.finish_reason == "stop"]  # these called the environment
    assert all(t.env_failures == 1 and t.turns == 1 for t in by_k[0] + by_k[1] if t in talked)
    assert any(t.env_failures == 1 for t in by_k[0]) and any(t.env_failures == 1 for t in by_k[1])
    assert all(t.env_failures == 0 for t in by_k[2])


class ResetFails(EchoCounter):
    """``reset`` raises for the record asking about 12 and 30; the others echo."""

    def reset(self, record):
        if "12" in record["question"]:
            raise RuntimeError("no such record")
        return super().reset(record)


class HeldEngine(EngineWrapper):
    """The module's engine inside a pipeline: a weight sync only relabels the version (nothing is
    trained here) and ``shutdown`` leaves it running for the other tests."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.version = inner.weight_version

    @property
    def weight_version(self) -> int:
        return self.version

    def load_weights(self, update, version: int) -> None:
        self.version = version

    def shutdown(self) -> None:
        pass


def reset_failure_pipeline(tokenizer, engine, runner):
    """One sync step over QUESTIONS (the second's reset fails) with the ``ResetFails`` environment."""
    from megatron_rl.control import FixedController
    from megatron_rl.data.records import PromptRecord, TokenizedPrompt
    from megatron_rl.pipeline import GroupScoring, Pipeline, PipelineSettings, RolloutInputs, StepSpan

    items = [
        TokenizedPrompt(record=PromptRecord(prompt_id=f"p{p}", answer="", text=q), token_ids=(1,))
        for p, q in enumerate(QUESTIONS)
    ]
    prompts = type("Prompts", (), {"next_batch": lambda self: items})()
    settings = MultiTurnSettings(
        max_turns=3,
        max_total_tokens=BUDGET,
        encode_prompt=partial(prompt_ids, tokenizer),
        encode_observation=partial(observation_ids, tokenizer),
        decode=partial(char_text, tokenizer),
    )
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=MAX_NEW, stop_token_ids=(tokenizer.eos_token_id,))
    multi = MultiTurnGenerator(
        settings=settings, env_factory=partial(ResetFails, turns=2), runner=runner, sampling=sampling
    )
    held = HeldEngine(engine)
    inputs = RolloutInputs(
        engine=held,
        prompts=prompts,
        generator=multi,
        reward_fn=lambda record, text: float(len(text)),
        controller=FixedController(G),
        scoring=GroupScoring(),
    )
    settings = PipelineSettings(mode="sync", micro_batch_tokens=4096, poll_s=0.01, join_timeout_s=30.0)
    return held, Pipeline(inputs, settings, StepSpan(num_steps=1))


def test_a_failed_reset_drops_its_group_and_past_the_limit_stops_the_run(setup):
    from megatron_rl.environments.runner import EnvironmentRunner
    from megatron_rl.pipeline import PipelineError

    _, tokenizer, engine = setup
    with EnvironmentRunner(timeout_s=30.0, max_failures=G) as runner:  # G resets fail: at the limit, not past it
        held, pipe = reset_failure_pipeline(tokenizer, engine, runner)
        with pipe:
            batch = pipe.begin_step()
            trained = [mb for mini in batch.mini_batches() for mb in mini]
            held.load_weights(None, 1)
            summary = pipe.complete(batch, 1)
        assert runner.stats().failures["raised"] == G and runner.stats().resets == 2 * G
    samples = [s for mb in trained for g in mb.groups for s in g.samples]
    assert sorted(s.request_id for s in samples) == [f"0/p0/{k}" for k in range(G)]  # p1 trained nothing
    assert [(g.prompt_id, len(g.samples), g.kept) for g in sorted(batch.groups, key=lambda g: g.prompt_index)] == [
        ("p0", G, True),
        ("p1", 0, False),
    ]
    assert summary.extra_metrics["multiturn/reset_failures"] == 1 and summary.trained_groups == 1
    assert summary.reward_mean == pytest.approx(sum(s.reward for s in samples) / G)
    assert len(summary.end.response_lengths) == G
    with (
        EnvironmentRunner(timeout_s=30.0, max_failures=G - 1) as runner,
        pytest.raises(PipelineError, match=r"EnvironmentFailureLimit: .*environment\.max_failures \(2\)"),
    ):
        with reset_failure_pipeline(tokenizer, engine, runner)[1] as pipe:
            pipe.begin_step().finish()
