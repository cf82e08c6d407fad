"""Reward calls in worker processes (``reward.workers`` > 0): off the producer thread and the GIL.

Contract: ``RewardPool(spec, workers=n, timeout_s=...)`` is a ``GuardedReward`` (same failure
kinds, counters and ``stats()``) whose ``submit(record, text)`` returns at once with a
``Future``; ``n`` processes (each loading ``spec`` itself) score the calls in parallel.
Each call scores exactly what the same function scores in-process (``GuardedReward``): a
result is a number or a counted failure, never a different number, so a run's rewards do
not depend on ``workers`` (``tests/test_rewards_pool.py`` checks it against the serial path).

Workers fork from a ``forkserver`` that imported this module once, so a replacement starts in
well under a second. Unlike the thread guard, a call that passes ``timeout_s`` is ended: its worker process is
killed (SIGKILL) and a fresh one replaces it before the next call, so a hung reward costs
one worker for ``timeout_s``, never a thread or the GIL for the rest of the run. A worker
that dies mid-call (a segfault, ``os._exit``, the OOM killer) scores that call 0, counted as
``crashed``, and is replaced the same way. A worker that cannot start (the spec does not
load, or no ``ready`` within ``start_timeout_s``) fails the call with ``RuntimeError``: the
producer then stops the run with it, as it does for an in-process error it cannot score.
``close()`` stops the workers (also at interpreter exit: they are daemons).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import traceback
from concurrent.futures import Future
from typing import Any

from megatron_rl.config.fields import require_values
from megatron_rl.data.records import PromptRecord
from megatron_rl.rewards.guard import GuardedReward, number_or_problem
from megatron_rl.rewards.loader import load_reward_fn

Answer = tuple[str, Any, str]  # (kind, value or message, traceback)


def _worker_main(spec: str, conn) -> None:
    """A worker process: load ``spec``, then answer (record, text) messages until None / EOF."""
    fn = load_reward_fn(spec)
    conn.send(("ready", None, ""))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the pool is gone
            return
        if message is None:
            return
        record, text = message
        try:
            value = fn(record, text)
        except Exception as err:  # a raising reward is an answer: the parent counts it as "raised"
            conn.send(("raised", f"{type(err).__name__}: {err}", traceback.format_exc()))
            continue
        number = number_or_problem(value)
        conn.send(("not_a_number", number, "") if isinstance(number, str) else ("value", number, ""))


class _Worker:
    """One worker process and its pipe, started with the pool and again after each kill."""

    def __init__(self, spec: str, start_timeout_s: float) -> None:
        self.spec, self.start_timeout_s = spec, start_timeout_s
        self.proc: Any = None
        self.conn: Any = None

    def call(self, record: PromptRecord, text: str, timeout_s: float | None) -> Answer:
        """One reward call: the worker's answer, ``("timeout", ...)`` or ``("crashed", ...)``."""
        self.start()
        try:
            self.conn.send((record, text))
        except (BrokenPipeError, ConnectionResetError):  # died between calls (killed from outside)
            self.kill()
            return ("crashed", "the reward worker process was gone; replaced", "")
        if not self.conn.poll(timeout_s):
            self.kill()
            return ("timeout", f"no result after {timeout_s} s (reward.timeout_s); worker process killed", "")
        try:
            return self.conn.recv()
        except EOFError:  # died mid-call
            self.proc.join(5.0)
            code = self.proc.exitcode
            self.kill()
            return ("crashed", f"the reward worker process died (exit code {code}); replaced", "")

    def start(self) -> None:
        """Start the process and wait for it to load the reward (no-op while it runs)."""
        if self.proc is not None:
            return
        ctx = mp.get_context("forkserver")  # the trainer process holds threads: never fork it
        ctx.set_forkserver_preload([__name__])  # each worker forks from a server that imported this once
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(self.spec, child), name="megatron_rl-reward", daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(self.start_timeout_s):
            self.kill()
            raise RuntimeError(f"reward worker for {self.spec!r} not ready after {self.start_timeout_s} s")
        try:
            self.conn.recv()
        except EOFError as err:
            code = self.proc.exitcode
            self.kill()
            raise RuntimeError(
                f"reward worker for {self.spec!r} died while loading it (exit code {code}); "
                f"reward.fn must import in a fresh process"
            ) from err

    def kill(self) -> None:
        """End the process now (SIGKILL); the next call starts a fresh one."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.conn.close()
        self.proc = self.conn = None

    def close(self) -> None:
        if self.proc is not None:
            self.conn.send(None)
            self.proc.join(5.0)
        self.kill()


class RewardPool(GuardedReward):
    """``GuardedReward`` scored by ``workers`` processes (see the module doc)."""

    def __init__(self, spec: str, *, workers: int, timeout_s: float | None, start_timeout_s: float = 300.0) -> None:
        super().__init__(load_reward_fn(spec), timeout_s=timeout_s, name=spec)  # refused here before any start
        require_values({"reward.workers": workers})
        if workers < 1:
            raise ValueError(f"reward.workers must be >= 1 for a RewardPool, got {workers}")
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = [_Worker(spec, start_timeout_s) for _ in range(workers)]
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

    def _serve(self, worker: _Worker) -> None:
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

    def _score(self, worker: _Worker, record: PromptRecord, text: str) -> float:
        kind, value, trace = worker.call(record, text, self.timeout_s)
        if kind == "value":
            return self._check(value, record)  # NaN / inf are counted as non_finite here
        return self._fail(kind, record, value, trace)
