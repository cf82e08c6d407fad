"""``trainer.dispatcher``: at DP > 1, rank 0's dispatcher thread sends the other replicas' groups
while replica 0 trains its own, keeps mini-batch order (nothing of mini-batch j + 1 before
optimizer step j), and gives every replica the samples the single-threaded loop gives it."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_rl.control import FixedController
from megatron_rl.pipeline import GroupScoring, Pipeline, PipelineSettings, RolloutInputs, StepSpan
from megatron_rl.trainer.loop import run_step
from megatron_rl.weight_sync.snapshot import SnapshotUpdate
from tests.pipeline_fakes import FakeEngine, FakePrompts, deadline, parity_reward, single_turn


class FakeLeader:
    """``LeaderReplica``'s calls, recorded; replica 0's micro-batches take ``train_s`` each."""

    def __init__(self, engine: FakeEngine, *, threaded: bool, train_s: float = 0.15) -> None:
        self.engine, self.train_s = engine, train_s
        self.dispatch = object() if threaded else None  # a channel: dispatch_ahead starts its thread
        self.events: list[tuple] = []  # ("mb", replica, mini_batch, samples, t0, t1) / ("step", j, t)
        self._lock, self._steps = threading.Lock(), 0

    def train_micro_batch(self, mb) -> None:
        t0 = time.monotonic()
        if mb.replica == 0:
            time.sleep(self.train_s)
        samples = tuple(sorted((g.prompt_id, s.index) for g in mb.groups for s in g.samples))
        with self._lock:
            self.events.append(("mb", mb.replica, mb.mini_batch, samples, t0, time.monotonic()))

    def optimizer_step(self) -> None:
        with self._lock:
            self.events.append(("step", self._steps, time.monotonic()))
            self._steps += 1

    def sync_weights(self, version: int) -> int:
        self.engine.load_weights(SnapshotUpdate(f"/snapshots/{version}"), version)
        return version


def _run(mode: str, threaded: bool) -> FakeLeader:
    engine = FakeEngine(order_seed=5, delay_s=0.02)
    inputs = RolloutInputs(
        engine=engine,
        prompts=FakePrompts([f"p{i}" for i in range(8)], per_batch=8),
        generator=single_turn(),
        reward_fn=parity_reward,
        controller=FixedController(4),
        scoring=GroupScoring(),
    )
    settings = PipelineSettings(
        mode=mode, seed=7, micro_batch_tokens=64, poll_s=0.01, mini_batches=2, join_timeout_s=5.0
    )
    pipe = Pipeline(inputs, settings, StepSpan(num_steps=1), replicas=3)
    leader = FakeLeader(engine, threaded=threaded)
    with deadline(120), pipe:
        run_step(pipe, leader)
    return leader


def _per_replica(leader: FakeLeader) -> dict[tuple[int, int], list]:
    out: dict[tuple[int, int], list] = {}
    for e in leader.events:
        if e[0] == "mb":
            out.setdefault((e[1], e[2]), []).extend(e[3])
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("mode", ["periodic", "sync"])
def test_the_dispatcher_thread_feeds_other_replicas_while_replica_0_trains(mode):
    threaded, plain = _run(mode, threaded=True), _run(mode, threaded=False)
    assert _per_replica(threaded) == _per_replica(plain)  # each replica trains the same samples per mini-batch
    assert {r for r, _ in _per_replica(threaded)} == {0, 1, 2}
    local, remote = _local(threaded), _remote(threaded)
    # periodic: groups arrive while replica 0 trains (sync cuts the whole batch first, replica 0 last)
    if mode == "periodic":
        assert any(t0 < t < t1 for t in remote for t0, t1 in local), "no group reached another replica while 0 trained"
        assert not any(t0 < t < t1 for t in _remote(plain) for t0, t1 in _local(plain))  # the old loop could not
    step_at = {e[1]: e[2] for e in threaded.events if e[0] == "step"}
    assert all(e[4] >= step_at[0] for e in threaded.events if e[0] == "mb" and e[2] == 1)  # after step 0


def _local(leader: FakeLeader) -> list[tuple[float, float]]:
    return [(e[4], e[5]) for e in leader.events if e[0] == "mb" and e[1] == 0]


def _remote(leader: FakeLeader) -> list[float]:
    return [e[4] for e in leader.events if e[0] == "mb" and e[1] != 0]


def test_bench_dispatcher_reports_its_figures_in_one_json_line(capsys):
    """``megatron_rl/bench/benchmarks/dispatcher.py`` at a tiny scale: one JSON line, every figure
    there, and a micro-batch shipped without its Sample records is smaller and pickles faster."""
    import json

    from megatron_rl.bench.benchmarks import run_benchmark

    assert (
        run_benchmark(
            "dispatcher",
            [
                "--replicas",
                "4",
                "--engines",
                "2",
                "--prompts",
                "8",
                "--group-size",
                "4",
                "--median-response",
                "64",
                "--max-response",
                "256",
                "--steps",
                "1",
            ],
        )
        == 0
    )
    (line,) = capsys.readouterr().out.strip().splitlines()
    report = json.loads(line)
    assert report["replicas"] == 4 and report["tokens_per_step"] > 8 * 4
    assert report["groups_per_s"] > 0 and report["mb_per_s"] > 0 and report["rank0_cpu_s_per_step"] > 0
    assert report["shipped_mb_per_1m_tokens"] < report["with_samples_mb_per_1m_tokens"]
