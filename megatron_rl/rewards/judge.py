"""``reward.kind: judge``: an LLM judge prompted with the task, the answer and a rubric; its verdict parsed.

Contract: ``JudgeReward(backend, settings, timeout_s=...)`` is a ``batched.BatchedReward``: the
calls queued together (up to reward.judge.batch; a group's samples finish together) become one
``backend.complete`` call, the judge's engines generating every verdict of the batch at once.
Each prompt is ``render(template, record, response, rubric)``; each verdict goes through the
parser (``PARSERS`` or a dotted path ``pkg.mod:fn`` taking the verdict text and returning a
number or None). A verdict the parser cannot read scores 0 and is counted as ``unparsed``.

``backend`` is any ``TextBackend`` (strings in, strings out, in order): at run time
``rollout.text.EngineText`` over judge engines of their own (``build_engine``), supervised like
the rollout engines, so a worker killed mid-batch is restarted and its requests re-issued: every
call is answered once. An engine out of restarts raises, and the run stops with that error.

A batch is waited for at most ``timeout_s`` (reward.timeout_s, like any reward call; the engines'
own rollout.request_timeout_s only finds hung workers): past it, each of its calls scores 0,
counted as ``timeout``, and the lane moves on. The abandoned ``complete`` finishes on a thread
of its own (the engines cannot drop requests mid-call); the next batch's wait includes it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol

from megatron_rl.config.resources import find_dotted
from megatron_rl.config.reward_rules import PLACEHOLDER, template_problems
from megatron_rl.config.schema_reward_model import JudgeConfig
from megatron_rl.data.records import PromptRecord
from megatron_rl.rewards.batched import Answer, BatchedReward, Call
from megatron_rl.rewards.model_reward import prompt_text

Parser = Callable[[str], float | None]
_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_SCORE = re.compile(rf"score\s*[:=]?\s*\**\s*({_NUMBER})", re.IGNORECASE)
_LAST_NUMBER = re.compile(_NUMBER)
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


class TextBackend(Protocol):
    """Generates one completion per prompt, returned in prompt order."""

    def complete(self, prompts: Sequence[str]) -> list[str]:
        """The completion of each prompt."""
        ...

    def shutdown(self) -> None:
        """Stop the engines behind it."""
        ...


def parse_score(verdict: str) -> float | None:
    """The number of the last 'Score: N' (also 'score = N', '**Score:** N'), any case; None without one."""
    found = _SCORE.findall(verdict)
    return float(found[-1]) if found else None


def parse_last_number(verdict: str) -> float | None:
    """The last number in the verdict; None without one."""
    found = _LAST_NUMBER.findall(verdict)
    return float(found[-1]) if found else None


def parse_yes_no(verdict: str) -> float | None:
    """1.0 if the last 'yes' / 'no' word is yes, 0.0 if it is no; None without either."""
    found = _YES_NO.findall(verdict)
    return (1.0 if found[-1].lower() == "yes" else 0.0) if found else None


PARSERS: dict[str, Parser] = {"score": parse_score, "last_number": parse_last_number, "yes_no": parse_yes_no}


def load_parser(spec: str) -> Parser:
    """The parser reward.judge.parser names: a builtin or a dotted path; ValueError naming the key."""
    if spec in PARSERS:
        return PARSERS[spec]
    if ":" not in spec:
        raise ValueError(f"reward.judge.parser: {spec!r} is not one of {sorted(PARSERS)} or 'pkg.mod:function'")
    fn, why = find_dotted(spec)
    if why or not callable(fn):
        raise ValueError(f"reward.judge.parser: {spec!r}: {why or 'not callable'}")
    return fn


def render(template: str, record: PromptRecord, response: str, rubric: str) -> str:
    """The judge's prompt: each known placeholder replaced once, every other brace kept."""
    values = {"question": prompt_text(record), "response": response, "reference": record.answer, "rubric": rubric}
    return PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def check_judge(settings: JudgeConfig) -> Parser:
    """The parser of ``settings`` once its template is known to be usable; ValueError naming the key."""
    problems = template_problems(settings.template, settings.rubric)
    if problems:
        raise ValueError(f"reward.judge.template: {'; '.join(problems)}")
    return load_parser(settings.parser)


class JudgeReward(BatchedReward):
    """``reward.kind: judge`` (see the module doc)."""

    def __init__(self, backend: TextBackend, settings: JudgeConfig, *, timeout_s: float | None) -> None:
        self.parse = check_judge(settings)
        self.backend, self.settings = backend, settings
        super().__init__(name="judge", timeout_s=timeout_s, batch=settings.batch)
        self.start()

    def _score_batch(self, lane: int, calls: Sequence[Call]) -> list[Answer]:
        s = self.settings
        prompts = [render(s.template, c.record, c.text, s.rubric) for c in calls]
        verdicts = bounded_call(self.backend.complete, prompts, timeout_s=self.timeout_s)
        if verdicts is None:
            why = f"no verdict after {self.timeout_s} s (reward.timeout_s); the judge's batch was abandoned"
            return [("timeout", why, "")] * len(calls)
        return [self._verdict(v) for v in verdicts]

    def _verdict(self, verdict: str) -> Answer:
        try:
            value = self.parse(verdict)
        except Exception as err:  # a parser that raises: its verdict is not read
            return ("unparsed", f"parser {self.settings.parser!r} raised {type(err).__name__}: {err}", "")
        if value is None:
            return ("unparsed", f"no score in the verdict {verdict!r:.120} (parser {self.settings.parser!r})", "")
        return ("value", value, "")

    def _release(self) -> None:
        self.backend.shutdown()


def bounded_call(
    fn: Callable[[list[str]], list[str]], prompts: list[str], *, timeout_s: float | None
) -> list[str] | None:
    """``fn(prompts)`` on a daemon thread, waited for ``timeout_s`` (None: no bound); None past it.
    An exception of ``fn`` is raised here (an engine out of restarts stops the run)."""
    if timeout_s is None:
        return fn(prompts)
    done: Future[list[str]] = Future()

    def run() -> None:
        try:
            done.set_result(fn(prompts))
        except BaseException as err:  # handed to the waiting lane
            done.set_exception(err)

    threading.Thread(target=run, name="megatron_rl-judge-call", daemon=True).start()
    try:
        return done.result(timeout=timeout_s)
    except TimeoutError:
        return None
