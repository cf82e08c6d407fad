"""A batch whose every prompt fails before generating (``FailedGroup``: every agent timed out, every
environment reset raised) ends as a batch of empty, not-kept groups: the step trains nothing, the
group-size controller sees no lengths (it keeps its G: no evidence) and the next batch runs."""

from __future__ import annotations

from megatron_rl.control import FixedController, SAGCController, SAGCSettings
from megatron_rl.generation.base import FailedGroup
from tests.pipeline_fakes import (
    FakeEngine,
    FakePrompts,
    FakeTrainer,
    deadline,
    make_pipeline,
    single_turn,
    train_one_step,
)


class FailsFirstBatch:
    """The fakes' single-turn generator, except that every prompt of step 0 fails."""

    def __init__(self) -> None:
        self._inner = single_turn()

    def run(self, engine, batch, *, stop, check_version):
        if batch.step == 0:
            yield from (
                FailedGroup(prompt_index=p, base=batch.group_id(p), error="timed out") for p in range(len(batch.items))
            )
            return
        yield from self._inner.run(engine, batch, stop=stop, check_version=check_version)

    def overlong_lengths(self, samples, max_len):
        return self._inner.overlong_lengths(samples, max_len)


def _steps(controller) -> list:
    engine = FakeEngine()
    prompts = FakePrompts([f"p{i}" for i in range(12)], per_batch=4)
    pipe = make_pipeline(engine, prompts=prompts, controller=controller, generator=FailsFirstBatch(), num_steps=2)
    trainer = FakeTrainer(engine)
    with deadline(60), pipe:
        return [train_one_step(pipe, trainer) for _ in range(2)]


def test_a_batch_of_failed_prompts_trains_nothing_and_the_run_goes_on():
    first, second = _steps(FixedController(4))
    assert first.trained_groups == 0 and first.end.response_lengths == () and first.end.groups_produced == 4
    assert second.trained_groups > 0 and len(second.end.response_lengths) == 16


def test_sagc_keeps_its_group_size_through_a_batch_with_no_response():
    controller = SAGCController(SAGCSettings(initial=4, candidates=(2, 4, 8)))
    first, second = _steps(controller)
    assert first.end.group_size == second.end.group_size == 4  # no evidence: the same G again
    assert controller.state_dict()["steps"] == 1  # only the second batch was observed
