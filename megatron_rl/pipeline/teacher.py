"""The teacher stage of on-policy distillation: each completed group's sampled tokens scored by a
teacher, between the producer's group completion and the queue.

A teacher is a ``RolloutEngine`` of its own (``rollout.build_engine`` on ``distill``'s settings:
its own checkpoint, engines and devices) that only ``score``s: teacher-forced
``log_softmax(logits / T)`` of every response token (``rollout.scoring``), T the trainer's
log-prob temperature. ``TeacherStage.submit`` hands a finished group to a thread pool and
returns at once, so the producer goes on collecting generation results while the teacher
scores; ``ready`` returns the groups scored so far (each sample with ``teacher_logprobs``) and
``drain`` waits for the rest before the batch's ``BatchEnd``. The trainer never waits on the
teacher except through the queue. Groups that are never trained (failed, or dropped by dynamic
sampling) pass through unscored.

Timing per batch (``batch_metrics``, logged under ``distill/``): ``teacher_s`` is the time inside
teacher calls (summed over concurrent calls), ``teacher_wall_s`` the span from the first
submission to the last answer, ``teacher_wait_s`` what the producer waited for the teacher after
the batch's last generation result: the teacher's added time per step. The rest of the span
overlapped generation (``teacher_overlap``, its fraction).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace

from megatron_rl.pipeline.records import ScoredGroup
from megatron_rl.rollout.scoring import ScoreRequest
from megatron_rl.rollout.types import RolloutEngine


@dataclass(frozen=True, kw_only=True)
class TeacherSettings:
    """How the teacher scores: the log-prob temperature and how many groups it scores at once."""

    temperature: float  # algorithm.temperature: the teacher's log-probs are taken as the student's
    concurrency: int  # distill.concurrency: groups in flight to the teacher engines

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"algorithm.temperature must be > 0, got {self.temperature}")
        if self.concurrency < 1:
            raise ValueError(f"distill.concurrency must be >= 1, got {self.concurrency}")


def teacher_scored(engine: RolloutEngine, group: ScoredGroup, temperature: float) -> ScoredGroup:
    """``group`` with every sample's ``teacher_logprobs``: one ``score`` call for its G responses."""
    requests = [
        ScoreRequest(
            request_id=s.request_id, prompt_ids=s.prompt_ids, response_ids=s.response_ids, temperature=temperature
        )
        for s in group.samples
    ]
    results = {r.request_id: r for r in engine.score(requests)}
    samples = []
    for s in group.samples:
        result = results.get(s.request_id)
        if result is None or len(result.logprobs) != len(s.response_ids):
            got = "no answer" if result is None else f"{len(result.logprobs)} log-probs"
            raise RuntimeError(f"teacher: {got} for request {s.request_id!r} ({len(s.response_ids)} tokens)")
        samples.append(replace(s, teacher_logprobs=tuple(result.logprobs)))
    return replace(group, samples=tuple(samples))


class TeacherStage:
    """Completed groups in, teacher-scored groups out, scored on a thread pool."""

    def __init__(self, engine: RolloutEngine, settings: TeacherSettings) -> None:
        self.engine, self.settings = engine, settings
        self._pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="megatron_rl-teacher")
        self._pending: list[Future] = []
        self._lock = threading.Lock()
        self._reset_timing()

    def _reset_timing(self) -> None:
        self._busy_s, self._wait_s = 0.0, 0.0
        self._first: float | None = None
        self._last: float | None = None

    def submit(self, group: ScoredGroup) -> None:
        """Score ``group`` in the background (at once: a group that is never trained passes through)."""
        future: Future = Future()
        if not group.kept or not group.samples:
            future.set_result(group)
        else:
            self._first = time.perf_counter() if self._first is None else self._first
            future = self._pool.submit(self._score, group)
        self._pending.append(future)

    def _score(self, group: ScoredGroup) -> ScoredGroup:
        start = time.perf_counter()
        scored = teacher_scored(self.engine, group, self.settings.temperature)
        end = time.perf_counter()
        with self._lock:
            self._busy_s += end - start
            self._last = end if self._last is None else max(self._last, end)
        return scored

    def ready(self) -> list[ScoredGroup]:
        """The groups scored so far, in submission order (re-raises a failed scoring's error)."""
        finished = [f.done() for f in self._pending]  # one look per future: it may finish meanwhile
        done = [f for f, d in zip(self._pending, finished, strict=True) if d]
        self._pending = [f for f, d in zip(self._pending, finished, strict=True) if not d]
        return [f.result() for f in done]

    def drain(self, stop: threading.Event, poll_s: float) -> list[ScoredGroup] | None:
        """Wait for every submitted group (counted as the teacher's added time); None if ``stop``
        was set first."""
        start, out = time.perf_counter(), []
        while self._pending:
            if stop.is_set():
                return None
            wait_futures(self._pending, timeout=poll_s, return_when=FIRST_COMPLETED)
            out.extend(self.ready())
        self._wait_s += time.perf_counter() - start
        return out

    def batch_metrics(self) -> dict[str, float]:
        """The batch's ``distill/teacher_*`` timings (module docstring); resets them for the next batch."""
        wall = 0.0 if self._first is None or self._last is None else self._last - self._first
        out = {
            "distill/teacher_s": self._busy_s,
            "distill/teacher_wall_s": wall,
            "distill/teacher_wait_s": self._wait_s,
            "distill/teacher_overlap": max(0.0, 1.0 - self._wait_s / wall) if wall > 0 else 0.0,
        }
        self._reset_timing()
        return out

    def shutdown(self) -> None:
        """Stop the thread pool (pending scorings are cancelled) and the teacher's engines."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()


def check_same_tokenizer(student, teacher, teacher_path: str) -> None:
    """``ValueError`` naming ``distill.teacher`` unless the two tokenizers (HF tokenizers) map every
    token and special token to the same id: the teacher scores the student's token ids as they are."""
    problems = []
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        diff = sorted(set(s_vocab.items()) ^ set(t_vocab.items()), key=str)[:3]
        problems.append(f"vocabularies differ ({len(s_vocab)} vs {len(t_vocab)} tokens; e.g. {diff})")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            problems.append(f"{name} {getattr(student, name, None)} vs {getattr(teacher, name, None)}")
    s_special = dict(zip(student.all_special_tokens, student.all_special_ids, strict=True))
    t_special = dict(zip(teacher.all_special_tokens, teacher.all_special_ids, strict=True))
    if s_special != t_special:
        problems.append(f"special tokens differ: {s_special} vs {t_special}")
    if problems:
        raise ValueError(
            f"distill.teacher: {teacher_path!r} does not share the student's tokenizer: "
            + "; ".join(problems)
            + " (the teacher must score the student's token ids: use a teacher of the same tokenizer)"
        )
