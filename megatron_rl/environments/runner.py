"""Environment calls off the producer thread, with a time limit and failure counts.

Contract: ``EnvironmentRunner(timeout_s=..., max_failures=..., workers=n)`` runs
``env.reset(record)`` / ``env.step(text)`` in a pool of `n` threads and returns at once with a
``Future`` (`submit_reset`, `submit_step`), so the rollout loop never waits on one trajectory's
tool call. Each call runs in a daemon thread of its own (rewards' `guard._Call`) that the pool
thread waits on for at most `timeout_s` (environment.step_timeout_s). A call fails when it
raises, runs past `timeout_s` or returns something off the contract (a step result that is no
`StepResult`, a non-finite reward, a turn not done with no observation; a reset that is no
non-empty list of messages). A failed step is answered with
``StepResult(observation=(), done=True, tool_errors=1, error=...)``: the trajectory ends, the
run goes on. A failed reset's future raises `EnvironmentCallFailed` (there is no prompt to
roll out; the loop drops that prompt). Each failure is counted by kind (`FAILURE_KINDS`) and
the first of each kind logged with its traceback. Once more than `max_failures` calls have
failed (environment.max_failures; None: never), every later future raises
`EnvironmentFailureLimit`, which stops the run. As for rewards, Python cannot kill a thread:
a call that never returns keeps its daemon thread (`EnvironmentStats.abandoned`); the sandbox
bounds its own subprocesses.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config.fields import require_values
from megatron_rl.environments.base import Environment, Message, StepResult
from megatron_rl.rewards.failures import FailureLog
from megatron_rl.rewards.guard import _Call, number_or_problem

logger = logging.getLogger(__name__)

FAILURE_KINDS = ("raised", "timeout", "bad_result")


class EnvironmentCallFailed(RuntimeError):
    """An environment's reset failed (raised, timed out or returned no messages)."""


class EnvironmentFailureLimit(RuntimeError):
    """More environment calls failed than environment.max_failures allows."""


@dataclass(frozen=True, kw_only=True)
class EnvironmentStats:
    """Counters of one runner since it was built."""

    resets: int = 0
    steps: int = 0
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_KINDS, 0))
    first_error: str | None = None
    abandoned: int = 0  # timed-out calls whose thread is still running
    seconds: float = 0.0  # wall time spent in environment calls (summed over calls)
    tool_calls: int = 0  # summed over the step results
    tool_errors: int = 0  # summed over the step results, failed steps included

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def as_metrics(self, prefix: str = "env/") -> dict[str, float]:
        """Flat numbers for the metrics log."""
        out = {
            f"{prefix}{name}": float(getattr(self, name))
            for name in ("resets", "steps", "seconds", "tool_calls", "tool_errors", "abandoned")
        }
        out[f"{prefix}failures"] = float(self.failed)
        return out | {f"{prefix}failures_{kind}": float(n) for kind, n in self.failures.items()}


class EnvironmentRunner:
    """Runs environment calls in a thread pool, guarded (see module doc)."""

    def __init__(self, *, timeout_s: float | None, max_failures: int | None, workers: int = 8, name: str = ""):
        require_values(
            {"environment.max_failures": max_failures}
            | ({"environment.step_timeout_s": timeout_s} if timeout_s is not None else {})
        )
        self.timeout_s, self.max_failures, self.name = timeout_s, max_failures, name or "environment"
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env")
        self._lock = threading.Lock()
        self._counts = {"resets": 0, "steps": 0, "seconds": 0.0, "tool_calls": 0, "tool_errors": 0}
        self._failures = FailureLog(
            FAILURE_KINDS, logger=logger, subject=f"environment {self.name}", consequence="the trajectory ends"
        )
        self._pending: list[threading.Thread] = []

    def submit_reset(self, env: Environment, record: Mapping[str, Any], *, tag: str = "") -> Future[list[Message]]:
        """A future of ``env.reset(record)`` (raises `EnvironmentCallFailed` when the call fails)."""
        return self._pool.submit(self._reset, env, record, tag or str(record.get("prompt_id", "")))

    def submit_step(self, env: Environment, model_turn: str, *, tag: str = "") -> Future[StepResult]:
        """A future of ``env.step(model_turn)``; a failed call gives a done `StepResult` with `error`."""
        return self._pool.submit(self._step, env, model_turn, tag)

    def close(self) -> None:
        """Stop taking calls; waits for running ones (each bounded by timeout_s)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> EnvironmentRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reset(self, env: Environment, record: Mapping[str, Any], tag: str) -> list[Message]:
        value, failure = self._guarded(lambda e, r: e.reset(r), env, record, "resets", tag)
        failure = failure or _messages_problem(value)
        if failure:
            raise EnvironmentCallFailed(self._fail(failure, "reset", tag))
        return [dict(m) for m in value]

    def _step(self, env: Environment, model_turn: str, tag: str) -> StepResult:
        value, failure = self._guarded(lambda e, t: e.step(t), env, model_turn, "steps", tag)
        failure = failure or _step_problem(value)
        if failure:
            message = self._fail(failure, "step", tag)
            value = StepResult(observation=(), done=True, tool_errors=1, error=message)
        with self._lock:
            self._counts["tool_calls"] += value.tool_calls
            self._counts["tool_errors"] += value.tool_errors
        return value

    def _guarded(
        self, fn: Callable[[Any, Any], Any], env: Environment, arg: Any, counter: str, tag: str
    ) -> tuple[Any, tuple[str, str, str] | None]:
        """(value, None) or (None, (kind, message, traceback)); raises past max_failures."""
        self._check_limit()
        start = time.perf_counter()
        call = _Call(fn, env, arg)
        call.thread.join(self.timeout_s)
        with self._lock:
            self._counts[counter] += 1
            self._counts["seconds"] += time.perf_counter() - start
            if call.thread.is_alive():
                self._pending.append(call.thread)
        if call.thread.is_alive():
            return None, ("timeout", f"no result after {self.timeout_s} s (environment.step_timeout_s)", "")
        if call.error is not None:
            return None, ("raised", f"{type(call.error).__name__}: {call.error}", call.trace)
        return call.value, None

    def _fail(self, failure: tuple[str, str, str], what: str, tag: str) -> str:
        kind, message, trace = failure
        text = f"{kind} in {what}{f' ({tag})' if tag else ''}: {message}"
        self._failures.record(kind, text, trace)
        self._check_limit()
        return text

    def _check_limit(self) -> None:
        failed = sum(self._failures.counts().values())
        if self.max_failures is not None and failed > self.max_failures:
            raise EnvironmentFailureLimit(
                f"{failed} environment calls failed, more than environment.max_failures "
                f"({self.max_failures}); the first: {self._failures.first_error}"
            )

    def stats(self) -> EnvironmentStats:
        """A snapshot of the counters."""
        with self._lock:
            self._pending = [t for t in self._pending if t.is_alive()]
            return EnvironmentStats(
                **self._counts,
                failures=self._failures.counts(),
                first_error=self._failures.first_error,
                abandoned=len(self._pending),
            )


def _messages_problem(value: Any) -> tuple[str, str, str] | None:
    """Why a reset's value is not a non-empty list of chat messages, or None."""
    ok = (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    )
    return None if ok else ("bad_result", f"reset returned {value!r:.80}, not a non-empty list of messages", "")


def _step_problem(value: Any) -> tuple[str, str, str] | None:
    """Why a step's value breaks the contract, or None."""
    if not isinstance(value, StepResult):
        return "bad_result", f"step returned {type(value).__name__} {value!r:.80}, not a StepResult", ""
    if value.reward is not None:
        number = number_or_problem(value.reward)
        if isinstance(number, str) or not math.isfinite(number):
            return "bad_result", f"step reward {value.reward!r:.40} is not a finite number", ""
    if not value.done and not value.observation:
        return "bad_result", "step is not done but has no observation for the next turn", ""
    bad = _messages_problem(list(value.observation)) if value.observation else None
    return ("bad_result", f"step observation: {bad[1]}", "") if bad else None
