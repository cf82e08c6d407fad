"""Reward calls in worker processes (``reward.workers`` > 0): off the producer thread and the GIL.

Contract: ``RewardPool(spec, workers=n, timeout_s=...)`` is a ``GuardedReward`` (same failure
kinds, counters and ``stats()``) whose ``submit(record, text)`` returns at once with a
``Future``; ``n`` processes (each loading ``spec`` itself) score the calls in parallel.
Each call scores exactly what the same function scores in-process (``GuardedReward``): a
result is a number or a counted failure, never a different number, so a run's rewards do
not depend on ``workers`` (``tests/test_rewards_pool.py`` checks it against the serial path).

Workers (``process_worker.ProcessWorker``) fork from a ``forkserver`` that imported this module
once, so a replacement starts in well under a second. Unlike the thread guard, a call that passes
``timeout_s`` is ended: its worker process is killed (SIGKILL) and a fresh one replaces it before
the next call, so a hung reward costs one worker for ``timeout_s``, never a thread or the GIL for
the rest of the run. A worker that dies mid-call (a segfault, ``os._exit``, the OOM killer) scores
that call 0, counted as ``crashed``, and is replaced the same way. A worker that cannot start (the
spec does not load, or no ``ready`` within ``start_timeout_s``) fails the call with
``RuntimeError``: the producer then stops the run with it, as it does for an in-process error it
cannot score. ``close()`` stops the workers (also at interpreter exit: they are daemons).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from megatron_rl.config.fields import require_values
from megatron_rl.data.records import PromptRecord
from megatron_rl.rewards.base import RewardFn
from megatron_rl.rewards.guard import GuardedReward, number_or_problem
from megatron_rl.rewards.loader import load_reward_fn
from megatron_rl.rewards.process_worker import Answer, ProcessWorker, WorkerSetup, serve


def _worker_main(spec: str, conn) -> None:
    """A worker process: load ``spec``, then answer (record, text) messages (``process_worker.serve``)."""
    serve(conn, lambda: _handler(load_reward_fn(spec)))


def _handler(fn: RewardFn) -> Callable[[tuple[PromptRecord, str]], Answer]:
    """One call's answer: its number, or ``not_a_number`` (an exception is answered ``raised``)."""

    def handle(message: tuple[PromptRecord, str]) -> Answer:
        number = number_or_problem(fn(*message))
        return ("not_a_number", number, "") if isinstance(number, str) else ("value", number, "")

    return handle


def _worker(spec: str, start_timeout_s: float) -> ProcessWorker:
    """A pool worker: forked from a ``forkserver`` that imported this module once (the trainer
    process holds threads: never fork it)."""
    return ProcessWorker(
        WorkerSetup(
            target=_worker_main,
            arg=spec,
            context="forkserver",
            preload=(__name__,),
            name="megatron_rl-reward",
            what=f"reward worker for {spec!r}:",
            hint="reward.fn must import in a fresh process",
            start_timeout_s=start_timeout_s,
        )
    )


class RewardPool(GuardedReward):
    """``GuardedReward`` scored by ``workers`` processes (see the module doc)."""

    def __init__(self, spec: str, *, workers: int, timeout_s: float | None, start_timeout_s: float = 300.0) -> None:
        super().__init__(load_reward_fn(spec), timeout_s=timeout_s, name=spec)  # refused here before any start
        require_values({"reward.workers": workers})
        if workers < 1:
            raise ValueError(f"reward.workers must be >= 1 for a RewardPool, got {workers}")
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = [_worker(spec, start_timeout_s) for _ in range(workers)]
        self._threads = [
            threading.Thread(target=self._serve, args=(w,), name="megatron_rl-reward-pool", daemon=True)
            for w in self._workers
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, record: PromptRecord, response_text: str) -> Future[float]:
        """Queue one call; the future holds its guarded reward (``RuntimeError`` if no worker starts)."""
        with self._lock:
            self._calls += 1
        future: Future[float] = Future()
        self._tasks.put((future, record, response_text))
        return future

    def __call__(self, record: PromptRecord, response_text: str) -> float:
        return self.submit(record, response_text).result()

    def close(self) -> None:
        """Stop the workers once the queued calls are done."""
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()

    def _serve(self, worker: ProcessWorker) -> None:
        failed: Exception | None = None
        try:
            worker.start()  # now, in parallel with the other workers, rather than at the first call
        except (RuntimeError, OSError) as err:  # the worker could not start: the callers' error
            failed = err
        while (task := self._tasks.get()) is not None:
            future, record, text = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if failed is not None:
                    raise failed
                future.set_result(self._score(worker, record, text))
            except (RuntimeError, OSError) as err:
                failed = err
                future.set_exception(err)
        worker.close()

    def _score(self, worker: ProcessWorker, record: PromptRecord, text: str) -> float:
        kind, value, trace = worker.call((record, text), self.timeout_s)
        if kind == "value":
            return self._check(value, record)  # NaN / inf are counted as non_finite here
        return self._fail(kind, record, value, trace)
