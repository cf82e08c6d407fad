"""``reward.kind: judge``: template, verdict parsers, batching, and the judge's engines.

Parser and template rows are written out by hand. A fake backend (fixed verdict text) shows
the batching: calls queued while a batch is out go together in the next one, each answered
once; an unreadable verdict scores 0 counted as ``unparsed``. A greedy hf judge engine on a
tiny model gives the verdicts transformers' own greedy ``generate`` gives. A judge engine killed
mid-batch (the rollout pool's restart) answers every call once, with the verdicts of a run
without the kill. A judge engine slower than reward.timeout_s scores its batch 0, counted as
``timeout``, within reward.timeout_s rather than the engine's own rollout.request_timeout_s.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.config.schema_reward_model import JudgeConfig
from megatron_rl.data.records import ChatMessage, PromptRecord
from megatron_rl.rewards.judge import (
    JudgeReward,
    load_parser,
    parse_last_number,
    parse_score,
    parse_yes_no,
    render,
    template_problems,
)

RECORD = PromptRecord(prompt_id="p", answer="12", text="What is 7 + 5?")
CALLS = [(RECORD, text) for text in ("12", "13", "I think 12", "twelve", "\\boxed{12}", "11")]


@pytest.mark.parametrize(
    "verdict, score, last_number, yes_no",
    [
        ("Score: 7", 7.0, 7.0, None),
        ("The answer is right.\nscore = 9.5", 9.5, 9.5, None),
        ("**Score:** 3 ... on reflection Score: 4", 4.0, 4.0, None),
        ("I give it 8 out of 10", None, 10.0, None),
        ("Yes, it is correct.", None, None, 1.0),
        ("At first yes, but no: 7 + 5 is 12.", None, 12.0, 0.0),
        ("SCORE: -2", -2.0, -2.0, None),
        ("no verdict here", None, None, 0.0),
        ("", None, None, None),
    ],
)
def test_parsers(verdict, score, last_number, yes_no):
    assert (parse_score(verdict), parse_last_number(verdict), parse_yes_no(verdict)) == (score, last_number, yes_no)


def test_parser_by_name_or_dotted_path():
    assert load_parser("yes_no") is parse_yes_no
    assert load_parser("megatron_rl.rewards.judge:parse_score") is parse_score
    with pytest.raises(ValueError, match="reward.judge.parser"):
        load_parser("scores")


def test_render_fills_each_placeholder_and_keeps_other_braces():
    chat = PromptRecord(
        prompt_id="c",
        answer="4",
        messages=(ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="2+2?")),
    )
    got = render("Q={question} A={response} R={reference} [{rubric}] \\boxed{x} {other}", chat, "4", "exact")
    assert got == "Q=Be brief.\n\n2+2? A=4 R=4 [exact] \\boxed{x} {other}"


@pytest.mark.parametrize(
    "template, rubric, problems",
    [
        ("{question} {response} {rubric}", "r", []),
        ("{question} {response}", "", []),
        ("{question} {response}", "r", ["no {rubric} placeholder for reward.judge.rubric"]),
        ("{question} {answer}", "", ["unknown placeholder {answer}", "no {response} placeholder"]),
        ("grade it", "", ["no {question} placeholder", "no {response} placeholder"]),
    ],
)
def test_template_problems(template, rubric, problems):
    assert template_problems(template, rubric) == problems


class FakeText:
    """Verdicts from a table of response -> verdict; the first call waits until ``release``."""

    def __init__(self, verdicts):
        self.verdicts, self.batches, self.release = verdicts, [], threading.Event()
        self.shut = False

    def complete(self, prompts):
        self.release.wait(30)
        self.batches.append(list(prompts))
        return [self.verdicts[p.rsplit("ANSWER:", 1)[1]] for p in prompts]

    def shutdown(self):
        self.shut = True


def test_calls_queued_together_are_judged_in_one_batch():
    verdicts = {
        "12": "Score: 10",
        "13": "Score: 0",
        "I think 12": "Score: 8",
        "twelve": "hmm",
        "\\boxed{12}": "Score: 10",
    }
    verdicts["11"] = "score: 1"
    backend = FakeText(verdicts)
    settings = JudgeConfig(template="{question} ANSWER:{response}", rubric="", batch=4)
    judge = JudgeReward(backend, settings, timeout_s=30)
    futures = [judge.submit(record, text) for record, text in CALLS]
    backend.release.set()
    got = [f.result(timeout=30) for f in futures]
    judge.close()
    assert got == [10.0, 0.0, 8.0, 0.0, 10.0, 1.0]
    assert sorted(len(b) for b in backend.batches)[-1] == 4 and sum(map(len, backend.batches)) == 6
    stats = judge.stats()
    assert stats.calls == 6 and stats.failures["unparsed"] == 1 and stats.failed == 1 and backend.shut


@pytest.fixture(scope="module")
def tiny_judge(tmp_path_factory):
    from tests.rl_fixtures import make_tiny_rl_model

    return make_tiny_rl_model(tmp_path_factory.mktemp("judge") / "model", seed=3)


def hf_greedy(path, prompts, max_new_tokens):
    """transformers' greedy generate of each prompt alone, decoded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        gen = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        out.append(tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
    return out


@pytest.mark.slow
def test_greedy_hf_judge_engine_gives_transformers_verdicts(tiny_judge):
    from megatron_rl.rollout.text import judge_text

    settings = JudgeConfig(
        model=str(tiny_judge),
        template="{question} ANSWER:{response} SCORE:",
        rubric="",
        parser="last_number",
        chat_template=False,
        dtype="float32",
        max_new_tokens=12,
        batch=8,
    )
    backend = judge_text(settings, RolloutConfig())
    judge = JudgeReward(backend, settings, timeout_s=60)
    try:
        prompts = [render(settings.template, r, t, "") for r, t in CALLS]
        verdicts = backend.complete(prompts)
        got = [judge.submit(r, t).result(timeout=120) for r, t in CALLS]
    finally:
        judge.close()
    want = hf_greedy(tiny_judge, prompts, 12)
    assert verdicts == want
    assert got == [parse_last_number(v) or 0.0 for v in want]
    assert judge.stats().failures["unparsed"] == sum(parse_last_number(v) is None for v in want)


def echo_judge(tmp_path, *, timeout_s=30, request_timeout_s=60, **env):
    from megatron_rl.models.synthetic import char_tokenizer
    from megatron_rl.rollout import SamplingSettings, WorkerPool
    from megatron_rl.rollout.text import EngineText
    from tests.rollout_faults import echo_specs

    specs = echo_specs(tmp_path, 2, **env)
    pool = WorkerPool(specs, max_batch_size=2, request_timeout_s=request_timeout_s, start_timeout_s=120)
    backend = EngineText(
        pool, char_tokenizer(), SamplingSettings(temperature=0, max_new_tokens=6), chat_template=False, prefix="judge"
    )
    return JudgeReward(backend, JudgeConfig(parser="last_number", batch=8), timeout_s=timeout_s), pool


@pytest.mark.slow
def test_a_judge_engine_killed_mid_batch_answers_every_call_once(tmp_path):
    (tmp_path / "once").mkdir()
    runs = {}
    for name, env in {
        "plain": {},
        "killed": {"FAULT_CRASH_ON": "judge:3", "FAULT_ONCE_DIR": str(tmp_path / "once")},
    }.items():
        judge, pool = echo_judge(tmp_path, **env)
        try:
            futures = [judge.submit(r, t) for r, t in CALLS]
            runs[name] = ([f.result(timeout=300) for f in futures], judge.stats(), pool.status())
        finally:
            judge.close()
    (plain, plain_stats, plain_status), (killed, killed_stats, status) = runs["plain"], runs["killed"]
    assert (tmp_path / "once" / "crash-judge:3").exists()  # the worker died on that request
    assert sum(w.restarts for w in status) == 1 and sum(w.restarts for w in plain_status) == 0
    assert killed == plain and killed_stats.calls == plain_stats.calls == len(CALLS)
    assert killed_stats.failures == plain_stats.failures


def echo_verdict_scores(backend, calls):
    """The echo engine's verdicts written out: its response to each rendered prompt, decoded and parsed."""
    from tests.rollout_faults import echo_response

    settings = JudgeConfig(parser="last_number")
    prompts = [render(settings.template, r, t, settings.rubric) for r, t in calls]
    texts = [backend.tokenizer.decode(echo_response(backend.encode(p), 6)) for p in prompts]
    return [parse_last_number(t) or 0.0 for t in texts]


def test_a_slow_judge_engine_is_bounded_by_reward_timeout_s(tmp_path):
    (tmp_path / "once").mkdir()
    hang = {"FAULT_HANG_ON": "judge:0", "FAULT_ONCE_DIR": str(tmp_path / "once")}  # the first request hangs once
    judge, pool = echo_judge(tmp_path, timeout_s=2.0, request_timeout_s=12, **hang)
    try:
        start = time.monotonic()
        first = [f.result(timeout=60) for f in [judge.submit(r, t) for r, t in CALLS]]
        waited = time.monotonic() - start
        stats = judge.stats()
        while any(t.name == "megatron_rl-judge-call" for t in threading.enumerate()):  # the abandoned call ends
            assert time.monotonic() - start < 120, "the abandoned judge call never finished"
            time.sleep(0.2)
        second = [f.result(timeout=60) for f in [judge.submit(r, t) for r, t in CALLS]]
        after = judge.stats()
    finally:
        judge.close()
    assert waited < 8, f"the judge's batch was waited for {waited:.1f} s, past reward.timeout_s=2"
    assert first == [0.0] * len(CALLS) and stats.failures["timeout"] == len(CALLS) == stats.failed
    assert second == echo_verdict_scores(judge.backend, CALLS) and after.failures["timeout"] == len(CALLS)
    assert after.calls == 2 * len(CALLS) and sum(w.restarts for w in pool.status()) == 1
