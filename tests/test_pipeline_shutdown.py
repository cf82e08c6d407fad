"""Shutdown paths: producer errors surface in the main thread with their cause, trainer errors stop
a blocked producer, and no producer thread outlives ``close()``. Every test runs under a
deadline, so a hang fails instead of blocking the suite."""

from __future__ import annotations

import dataclasses
import time

import pytest

from megatron_rl.pipeline import Pipeline, PipelineError
from tests.pipeline_fakes import (
    FakeEngine,
    FakePrompts,
    FakeTrainer,
    deadline,
    make_pipeline,
    producer_threads,
    train_one_step,
)


@pytest.fixture(autouse=True)
def _no_leftover_threads():
    assert not producer_threads()
    with deadline(30):
        yield
    assert not producer_threads()


def test_engine_error_surfaces_as_pipeline_error_with_its_cause():
    engine = FakeEngine(fail_after=5)
    pipe = make_pipeline(engine).start()
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match="engine exploded") as info:
        train_one_step(pipe, FakeTrainer(engine))
    assert time.monotonic() - t0 < 5
    assert isinstance(info.value.__cause__, RuntimeError) and str(info.value.__cause__) == "engine exploded"
    assert engine.shutdown_calls == 1 and not producer_threads()


def test_engine_error_in_a_later_step():
    engine = FakeEngine()
    trainer = FakeTrainer(engine)
    with make_pipeline(engine, num_steps=3) as pipe:
        train_one_step(pipe, trainer)
        engine.fail_after = 0  # the producer is waiting for version 1; the next generate fails
        with pytest.raises(PipelineError) as info:
            train_one_step(pipe, trainer)
    assert str(info.value.__cause__) == "engine exploded" and engine.shutdown_calls == 1


def test_reward_error_surfaces_with_its_cause():
    engine = FakeEngine()
    boom = KeyError("answer")

    def bad_reward(record, text):
        raise boom

    with make_pipeline(engine, reward_fn=bad_reward) as pipe, pytest.raises(PipelineError) as info:
        train_one_step(pipe, FakeTrainer(engine))
    assert info.value.__cause__ is boom and engine.shutdown_calls == 1


def test_trainer_error_stops_a_producer_blocked_on_a_full_queue():
    engine = FakeEngine()
    pipe = make_pipeline(engine, queue_size=1, mode="stale", max_staleness=2, num_steps=5)
    trainer = FakeTrainer(engine, fail_micro_at=0, sleep_s=0.2)  # the producer refills the queue meanwhile
    with pipe:
        time.sleep(0.1)  # the producer fills the queue and blocks on put
        assert engine.calls == [(0, 0)]  # stale mode would otherwise have started step 1 already
        with pytest.raises(ValueError, match="trainer exploded"):
            train_one_step(pipe, trainer)
        assert engine.calls == [(0, 0)] and len(engine.results) < 24  # it was still blocked in step 0
    assert engine.shutdown_calls == 1 and not producer_threads()


def test_trainer_error_in_finish_batch_stops_a_producer_waiting_for_a_version():
    engine = FakeEngine()
    trainer = FakeTrainer(engine, fail_finish_at=0)
    with pytest.raises(ValueError, match="optimizer exploded"), make_pipeline(engine, mode="periodic") as pipe:
        train_one_step(pipe, trainer)
    assert len(trainer.micro_batches) >= 1 and engine.shutdown_calls == 1


def test_a_stuck_engine_is_released_by_close():
    engine = FakeEngine(block_after=3)
    pipe = make_pipeline(engine).start()
    time.sleep(0.05)
    pipe.close()  # stop cannot reach a thread inside generate; engine.shutdown() does
    assert engine.shutdown_calls == 1 and not producer_threads()


def test_finish_batch_must_load_the_new_version():
    class NoSync(FakeTrainer):
        def sync_weights(self, version):
            return version  # forgets engine.load_weights

    engine = FakeEngine()
    with make_pipeline(engine) as pipe, pytest.raises(RuntimeError, match="must call engine.load_weights"):
        train_one_step(pipe, NoSync(engine))


def test_close_is_idempotent_and_a_closed_pipeline_refuses_work():
    engine = FakeEngine()
    trainer = FakeTrainer(engine)
    pipe = make_pipeline(engine, num_steps=1)
    with pipe:
        train_one_step(pipe, trainer)
        with pytest.raises(PipelineError, match="already trained"):
            train_one_step(pipe, trainer)
    pipe.close()
    assert engine.shutdown_calls == 1
    with pytest.raises(PipelineError, match="closed"):
        train_one_step(pipe, trainer)


def test_bad_settings_are_named():
    engine = FakeEngine()
    with pytest.raises(ValueError, match="'stale' needs max_staleness >= 1"):
        make_pipeline(engine, mode="stale")
    with pytest.raises(ValueError, match="queue_size"):
        make_pipeline(engine, queue_size=0)
    prompts = FakePrompts(["a", "a"], per_batch=2)
    with pytest.raises(PipelineError) as info, make_pipeline(engine, prompts=prompts) as pipe:
        train_one_step(pipe, FakeTrainer(engine))
    assert "appears twice" in str(info.value.__cause__)
    assert isinstance(pipe, Pipeline)


def test_a_sample_from_the_wrong_version_is_an_error():
    class Lying(FakeEngine):
        def _answer(self, req):
            result = super()._answer(req)
            return dataclasses.replace(result, weight_version=result.weight_version + 1)

    engine = Lying()
    with pytest.raises(PipelineError) as info, make_pipeline(engine) as pipe:
        train_one_step(pipe, FakeTrainer(engine))
    assert isinstance(info.value.__cause__, RuntimeError) and "allows [0, 0]" in str(info.value.__cause__)
