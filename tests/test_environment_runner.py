"""EnvironmentRunner: environment calls run off the caller's thread; one that raises, hangs or
breaks the contract ends its trajectory with a counted failure, never a hung or crashed caller;
past environment.max_failures the run is stopped; turns of different trajectories overlap."""

from __future__ import annotations

import math
import threading
import time

import pytest

from megatron_rl.environments import StepResult, load_environment
from megatron_rl.environments.runner import EnvironmentCallFailed, EnvironmentFailureLimit, EnvironmentRunner

RECORD = {"prompt_id": "p0", "messages": [{"role": "user", "content": "q"}]}


class Faulty:
    """An environment whose step does what `mode` says."""

    tools: tuple[dict, ...] = ()

    def __init__(self, mode: str, release: threading.Event | None = None):
        self.mode, self.release = mode, release

    def reset(self, record):
        if self.mode == "reset_raises":
            raise KeyError("question")
        return [] if self.mode == "reset_empty" else list(record["messages"])

    def step(self, model_turn):
        if self.mode == "raises":
            raise RuntimeError("tool server down")
        if self.mode == "hangs":
            self.release.wait(30)
        if self.mode == "sleeps":
            time.sleep(0.5)
        return {
            "raises": None,
            "not_a_result": {"done": True},
            "nan": StepResult(observation=(), done=True, reward=math.nan),
            "no_observation": StepResult(observation=(), done=False),
        }.get(self.mode, StepResult(observation=({"role": "user", "content": "ok"},), done=False, tool_calls=2))


def test_results_equal_direct_calls():
    direct, guarded = load_environment("echo", turns=2)(), load_environment("echo", turns=2)()
    with EnvironmentRunner(timeout_s=5.0, max_failures=0) as runner:
        assert runner.submit_reset(guarded, RECORD).result() == direct.reset(RECORD)
        for text in ("one", "two <tool_call>{}</tool_call>"):
            assert runner.submit_step(guarded, text).result() == direct.step(text)
        stats = runner.stats()
    assert (stats.resets, stats.steps, stats.failed, stats.tool_calls, stats.tool_errors) == (1, 2, 0, 1, 1)
    assert stats.as_metrics()["env/steps"] == 2.0 and stats.seconds >= 0


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        ("raises", "raised"),
        ("not_a_result", "bad_result"),
        ("nan", "bad_result"),
        ("no_observation", "bad_result"),
    ],
)
def test_a_failing_step_ends_its_trajectory(mode, kind, caplog):
    with EnvironmentRunner(timeout_s=5.0, max_failures=10, name="faulty") as runner:
        result = runner.submit_step(Faulty(mode), "turn", tag="p0/1").result()
        stats = runner.stats()
    assert result.done and result.tool_errors == 1 and result.observation == ()
    assert result.error.startswith(f"{kind} in step (p0/1)")
    assert stats.failures[kind] == 1 and stats.failed == 1 and stats.first_error == result.error
    assert "environment faulty" in caplog.text


def test_a_hung_step_times_out_without_blocking_the_caller():
    release = threading.Event()
    runner = EnvironmentRunner(timeout_s=0.3, max_failures=10)
    try:
        start = time.perf_counter()
        future = runner.submit_step(Faulty("hangs", release), "turn")
        assert time.perf_counter() - start < 0.1 and not future.done()  # returned at once
        result = future.result(timeout=5)
        assert 0.3 <= time.perf_counter() - start < 3
        assert result.done and result.error.startswith("timeout") and runner.stats().abandoned == 1
        assert runner.submit_step(Faulty("ok"), "next").result(timeout=5).tool_calls == 2  # the pool is free
    finally:
        release.set()
        runner.close()
    assert runner.stats().failures["timeout"] == 1


@pytest.mark.parametrize("mode", ["reset_raises", "reset_empty"])
def test_a_failing_reset_raises_in_its_future(mode):
    with EnvironmentRunner(timeout_s=5.0, max_failures=10) as runner:
        with pytest.raises(EnvironmentCallFailed, match="in reset \\(p0\\)"):
            runner.submit_reset(Faulty(mode), RECORD).result()
        assert runner.stats().failed == 1


def test_failure_limit_stops_the_run():
    with EnvironmentRunner(timeout_s=5.0, max_failures=1) as runner:
        assert runner.submit_step(Faulty("raises"), "a").result().done  # 1 failure: allowed
        with pytest.raises(EnvironmentFailureLimit, match="environment.max_failures"):
            runner.submit_step(Faulty("raises"), "b").result()
        with pytest.raises(EnvironmentFailureLimit):
            runner.submit_step(Faulty("ok"), "c").result()


def test_steps_of_different_trajectories_overlap():
    with EnvironmentRunner(timeout_s=5.0, max_failures=0, workers=4) as runner:
        start = time.perf_counter()
        futures = [runner.submit_step(Faulty("sleeps"), "t") for _ in range(4)]
        assert all(f.result().tool_calls == 2 for f in futures)
        assert time.perf_counter() - start < 1.5  # 4 × 0.5 s in parallel, not 2 s in a row


def test_runner_refuses_bad_settings():
    with pytest.raises(ValueError, match="environment.step_timeout_s"):
        EnvironmentRunner(timeout_s=0, max_failures=1)
    with pytest.raises(ValueError, match="environment.max_failures"):
        EnvironmentRunner(timeout_s=1.0, max_failures=-1)
