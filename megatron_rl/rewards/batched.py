"""A guarded reward scored a batch at a time, off the producer thread: the base of the model
rewards (``judge.JudgeReward``, ``model_reward.RewardModelReward``).

Contract: ``submit(record, text)`` queues one call and returns a ``Future`` at once. Each of
``lanes`` daemon threads (one per judge client / reward-model worker) takes the calls queued at
that moment, up to ``batch``, and hands them to ``_score_batch`` in one go: while one batch is
scored, the next one gathers, so a group whose samples finish together is scored together. Each
call gets one ``Answer``: ``("value", number, "")`` is checked like any reward (NaN / inf count as
``non_finite``), any other kind scores 0 and is counted under that kind (``guard.FAILURE_KINDS``).
An exception out of ``_score_batch`` (an engine out of restarts, a worker that cannot start) is
set on every future of the batch: the producer stops the run with it. Every call is answered
exactly once. ``close()`` lets the queued calls finish, then stops the lanes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from megatron_rl.data.records import PromptRecord
from megatron_rl.rewards.guard import GuardedReward

Answer = tuple[str, Any, str]  # (kind, value or message, traceback), as pool.py's workers answer


@dataclass(frozen=True)
class Call:
    """One queued reward call."""

    record: PromptRecord
    text: str


class BatchedReward(GuardedReward):
    """``GuardedReward`` whose calls are scored in batches by ``lanes`` threads (see module doc)."""

    def __init__(self, *, name: str, timeout_s: float | None, batch: int, lanes: int = 1) -> None:
        super().__init__(self._unbatched, timeout_s=timeout_s, name=name)
        if batch < 1 or lanes < 1:
            raise ValueError(f"reward {name}: batch and lanes must be >= 1, got {batch} and {lanes}")
        self.batch = batch
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, args=(i,), name=f"megatron_rl-reward-{name}-{i}", daemon=True)
            for i in range(lanes)
        ]
        self._closed = False

    def start(self) -> None:
        """Start the lanes (subclasses call it once their clients are ready)."""
        for thread in self._threads:
            thread.start()

    def submit(self, record: PromptRecord, response_text: str) -> Future[float]:
        """Queue one call; the future holds its guarded reward (the exception that stopped the batch)."""
        with self._lock:
            self._calls += 1
        future: Future[float] = Future()
        self._tasks.put((future, Call(record, response_text)))
        return future

    def __call__(self, record: PromptRecord, response_text: str) -> float:
        return self.submit(record, response_text).result()

    def close(self) -> None:
        """Score what is queued, then stop the lanes and release the clients (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            if thread.ident is not None:
                thread.join()
        self._release()

    def _score_batch(self, lane: int, calls: Sequence[Call]) -> list[Answer]:
        """One ``Answer`` per call, in order (subclasses)."""
        raise NotImplementedError

    def _release(self) -> None:
        """Free the clients after the lanes stopped (subclasses)."""

    def _unbatched(self, record: PromptRecord, response_text: str) -> float:
        raise RuntimeError(f"reward {self.name} is scored in batches: use submit()")

    def _next_batch(self) -> tuple[list[tuple[Future, Call]], bool]:
        """The calls queued now (waiting for the first), up to ``batch``; True once told to stop."""
        first = self._tasks.get()
        if first is None:
            return [], True
        tasks = [first]
        while len(tasks) < self.batch:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is None:
                return tasks, True
            tasks.append(task)
        return tasks, False

    def _serve(self, lane: int) -> None:
        stop = False
        while not stop:
            tasks, stop = self._next_batch()
            tasks = [(f, c) for f, c in tasks if f.set_running_or_notify_cancel()]
            if not tasks:
                continue
            try:
                answers = self._score_batch(lane, [c for _, c in tasks])
                if len(answers) != len(tasks):
                    raise RuntimeError(f"reward {self.name}: {len(answers)} answers for {len(tasks)} calls")
            except Exception as err:  # the batch cannot be scored: the run's error (see module doc)
                for future, _ in tasks:
                    future.set_exception(err)
                continue
            for (future, call), answer in zip(tasks, answers, strict=True):
                future.set_result(self._settle(call, answer))

    def _settle(self, call: Call, answer: Answer) -> float:
        kind, value, trace = answer
        if kind == "value":
            return self._check(value, call.record)
        return self._fail(kind, call.record, str(value), trace)
