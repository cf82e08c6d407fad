"""``reward.kind: combined``: a weighted sum of rewards (a function, a judge, a reward model).

Contract: ``CombinedReward({"function": r1, "model": r2}, {"function": 1.0, "model": 0.5})`` is a
``GuardedReward``: ``submit(record, text)`` submits the call to every component at once (each
scores it in its own way: thread, worker processes, judge engines) and its future holds
Σ weight × component reward, set when the last component answers (a component's exception
instead, which stops the run). A component's failure is its own: it scores 0 there, counted in
its counters. ``stats()`` sums the components' failure counts by kind and adds, per component,
``<name>_mean`` (the mean of its rewards answered since the previous ``stats()``: one step's,
as the loop reads it once a step) and ``<name>_failures`` (its failures so far): the metrics
``reward/function_mean``, ``reward/judge_failures``, ...
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future

from megatron_rl.data.records import PromptRecord
from megatron_rl.rewards.guard import FAILURE_KINDS, GuardedReward, RewardStats


class CombinedReward(GuardedReward):
    """A weighted sum of guarded rewards (see the module doc)."""

    def __init__(self, components: Mapping[str, GuardedReward], weights: Mapping[str, float]) -> None:
        if not components or set(components) != set(weights):
            raise ValueError(f"reward.weights {dict(weights)} must name exactly the components {sorted(components)}")
        super().__init__(self._unsubmitted, timeout_s=None, name="combined")
        self.components, self.weights = dict(components), dict(weights)
        self._sums = dict.fromkeys(components, 0.0)
        self._counts = dict.fromkeys(components, 0)

    def submit(self, record: PromptRecord, response_text: str) -> Future[float]:
        """A future of Σ weight × component reward (see the module doc)."""
        with self._lock:
            self._calls += 1
        out: Future[float] = Future()
        parts = {name: reward.submit(record, response_text) for name, reward in self.components.items()}
        remaining = [len(parts)]
        lock = threading.Lock()

        def done(_: Future) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            self._finish(out, parts)

        for future in parts.values():
            future.add_done_callback(done)
        return out

    def __call__(self, record: PromptRecord, response_text: str) -> float:
        return self.submit(record, response_text).result()

    def _finish(self, out: Future[float], parts: Mapping[str, Future]) -> None:
        errors = [f.exception() for f in parts.values() if f.exception() is not None]
        if errors:
            out.set_exception(errors[0])
            return
        values = {name: float(f.result()) for name, f in parts.items()}
        with self._lock:
            for name, value in values.items():
                self._sums[name] += value
                self._counts[name] += 1
        out.set_result(sum(self.weights[name] * value for name, value in values.items()))

    def _unsubmitted(self, record: PromptRecord, response_text: str) -> float:
        return self(record, response_text)

    def stats(self) -> RewardStats:
        """The components' counters summed, with per-component metrics (means since the last call)."""
        parts = {name: reward.stats() for name, reward in self.components.items()}
        extra: dict[str, float] = {}
        with self._lock:
            for name, stats in parts.items():
                if self._counts[name]:
                    extra[f"{name}_mean"] = self._sums[name] / self._counts[name]
                extra[f"{name}_failures"] = float(stats.failed)
                self._sums[name], self._counts[name] = 0.0, 0
            calls = self._calls
        failures = {kind: sum(s.failures.get(kind, 0) for s in parts.values()) for kind in FAILURE_KINDS}
        first = next((f"{n}: {s.first_error}" for n, s in parts.items() if s.first_error), None)
        abandoned = sum(s.abandoned for s in parts.values())
        return RewardStats(calls=calls, failures=failures, first_error=first, abandoned=abandoned, extra=extra)

    def close(self) -> None:
        """Close the components that hold processes or engines."""
        for reward in self.components.values():
            close = getattr(reward, "close", None)
            if close is not None:
                close()
