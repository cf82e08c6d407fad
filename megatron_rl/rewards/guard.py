"""A reward function that never stops training: failures score 0 and are counted.

Contract: ``GuardedReward(fn, timeout_s=...)`` is itself a ``RewardFn``. For each call it
returns ``float(fn(record, text))`` when that is a finite number obtained within
``timeout_s``; otherwise it returns 0.0 and counts the failure by kind:

    raised        fn raised an exception (any ``Exception``; the first is logged with its traceback)
    timeout       fn ran longer than ``timeout_s`` (reward.timeout_s)
    not_a_number  fn returned something that is not a real number (a str, None, a list, ...)
    non_finite    fn returned NaN or ±inf
    crashed       the worker process running fn died (``pool.RewardPool`` only; it is replaced)
    unparsed      an LLM judge's verdict held no score its parser could read (``judge.JudgeReward``)

``stats()`` returns a ``RewardStats`` snapshot (thread-safe) the loop can log. The first
failure of each kind is logged once, naming the prompt.

Time limit: the call runs in a daemon thread of its own, and the caller stops waiting after
``timeout_s``. Python cannot kill a thread, so a call that never returns keeps its thread
(counted in ``RewardStats.abandoned`` while it runs); a call stuck in C code holding the GIL
(e.g. huge sympy integers) still slows the process: builtins refuse such inputs up front
(``builtin.py``). ``timeout_s=None`` calls ``fn`` inline (no time limit). ``pool.RewardPool``
runs the calls in worker processes instead (``reward.workers``), where a hung call is killed.

``submit(record, text)`` is the producer's entry point: a ``Future`` of the guarded reward
(here computed at once, in the caller's thread; the pool returns before the call is done).
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field

from megatron_rl.config.fields import require_values
from megatron_rl.data.records import PromptRecord
from megatron_rl.rewards.base import RewardFn
from megatron_rl.rewards.failures import FailureLog

logger = logging.getLogger(__name__)

FAILURE_KINDS = ("raised", "timeout", "not_a_number", "non_finite", "crashed", "unparsed")


@dataclass(frozen=True, kw_only=True)
class RewardStats:
    """Counters of one guarded reward function since it was built."""

    calls: int = 0
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_KINDS, 0))
    first_error: str | None = None  # "<kind> on prompt <id>: <message>" of the first failure
    abandoned: int = 0  # timed-out calls whose thread is still running
    extra: dict[str, float] = field(default_factory=dict)  # more metrics under the prefix (combine.py's per component)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def as_metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Flat numbers for the metrics log: calls, failures and one count per kind."""
        out = {f"{prefix}calls": float(self.calls), f"{prefix}failures": float(self.failed)}
        out |= {f"{prefix}failures_{kind}": float(n) for kind, n in self.failures.items()}
        return out | {f"{prefix}{name}": value for name, value in self.extra.items()}


def number_or_problem(value: object) -> float | str:
    """``float(value)`` for a real number (NaN / inf included), else why it is not a number."""
    if isinstance(value, str | bytes) or not (isinstance(value, numbers.Real) or hasattr(type(value), "__float__")):
        return f"returned {type(value).__name__} {value!r:.80}, not a number"
    try:
        return float(value)
    except (TypeError, ValueError) as err:  # e.g. a tensor of several elements
        return f"returned {type(value).__name__} ({err}), not a number"


class _Call:
    """One reward call in a daemon thread; ``join(timeout)`` says whether it finished."""

    def __init__(self, fn: RewardFn, record: PromptRecord, text: str):
        self.value: object = None
        self.error: BaseException | None = None
        self.trace = ""
        self._args = (fn, record, text)
        self.thread = threading.Thread(target=self._run, name="reward-call", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        fn, record, text = self._args
        try:
            self.value = fn(record, text)
        except Exception as err:  # reported by the guard as a "raised" failure, with its traceback
            self.error, self.trace = err, traceback.format_exc()


class GuardedReward:
    """``RewardFn`` wrapper: failures score 0.0 and are counted (see module doc)."""

    def __init__(self, fn: RewardFn, *, timeout_s: float | None, name: str = ""):
        if timeout_s is not None:  # None: no limit (inline); else the config's rule
            require_values({"reward.timeout_s": timeout_s})
        self.fn, self.timeout_s, self.name = fn, timeout_s, name or getattr(fn, "__name__", repr(fn))
        self._lock = threading.Lock()
        self._calls = 0
        self._failures = FailureLog(FAILURE_KINDS, logger=logger, subject=f"reward {self.name}", consequence="scored 0")
        self._pending: list[threading.Thread] = []  # timed-out calls

    def __call__(self, record: PromptRecord, response_text: str) -> float:
        with self._lock:
            self._calls += 1
        if self.timeout_s is None:
            try:
                value = self.fn(record, response_text)
            except Exception as err:  # a raising reward scores 0: counted, training goes on
                return self._fail("raised", record, f"{type(err).__name__}: {err}", traceback.format_exc())
            return self._check(value, record)
        call = _Call(self.fn, record, response_text)
        call.thread.join(self.timeout_s)
        if call.thread.is_alive():
            with self._lock:
                self._pending.append(call.thread)
            return self._fail("timeout", record, f"no result after {self.timeout_s} s (reward.timeout_s)")
        if call.error is not None:
            return self._fail("raised", record, f"{type(call.error).__name__}: {call.error}", call.trace)
        return self._check(call.value, record)

    def submit(self, record: PromptRecord, response_text: str) -> Future[float]:
        """A future of ``self(record, response_text)``; here already done (computed in this thread)."""
        future: Future[float] = Future()
        future.set_result(self(record, response_text))
        return future

    def _check(self, value: object, record: PromptRecord) -> float:
        number = number_or_problem(value)
        if isinstance(number, str):
            return self._fail("not_a_number", record, number)
        if not math.isfinite(number):
            return self._fail("non_finite", record, f"returned {number}")
        return number

    def _fail(self, kind: str, record: PromptRecord, message: str, trace: str = "") -> float:
        self._failures.record(kind, f"{kind} on prompt {record.prompt_id!r}: {message}", trace)
        return 0.0

    def stats(self) -> RewardStats:
        """A snapshot of the counters."""
        with self._lock:
            self._pending = [t for t in self._pending if t.is_alive()]
            return RewardStats(
                calls=self._calls,
                failures=self._failures.counts(),
                first_error=self._failures.first_error,
                abandoned=len(self._pending),
            )
