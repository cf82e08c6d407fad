"""Adding a generator touches one file: the generator below is registered here, built by name and
run through a real ``Pipeline`` (the fakes' engine, prompts and trainer): its trajectories become
the trained samples, an environment reward is kept, the task reward scores the others, and DAPO
overlong shaping measures what the generator says. Plus the registry's own rules."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from megatron_rl.algorithms import overlong_reward_delta
from megatron_rl.control import FixedController
from megatron_rl.generation import (
    BatchRequest,
    GeneratorSetup,
    OverlongLengths,
    SingleTurnGenerator,
    Trajectory,
    build_generator,
    register_generator,
)
from megatron_rl.pipeline import GroupScoring, OverlongShaping, Pipeline, PipelineSettings, RolloutInputs, StepSpan
from megatron_rl.rollout.types import SamplingSettings
from tests.pipeline_fakes import FakeEngine, FakePrompts, FakeTrainer, deadline, train_one_step

G, BUDGET = 3, 2  # the generator's own overlong budget (not the configured max_len)


@register_generator("test_counting")
class CountingGenerator:
    """Trajectory k of a prompt answers k + 1 tokens of value k + 3; even k carry an environment
    reward of 1.0, odd k leave the reward to the task reward function (text: "k")."""

    def __init__(self, setup: GeneratorSetup) -> None:
        self.checked: list[tuple[str, int]] = []

    def run(
        self,
        engine,
        batch: BatchRequest,
        *,
        stop: threading.Event,
        check_version: Callable[[str, int], None],
    ) -> Iterator[Trajectory]:
        for p, item in enumerate(batch.items):
            for k in range(batch.group_size):
                rid, version = batch.request_id(p, k), engine.weight_version
                check_version(rid, version)
                self.checked.append((rid, version))
                yield Trajectory(
                    request_id=rid,
                    prompt_index=p,
                    k=k,
                    prompt_ids=tuple(item.token_ids),
                    response_ids=(k + 3,) * (k + 1),
                    loss_mask=None,
                    behav_logprobs=(-0.1,) * (k + 1),
                    turn_versions=(version,),
                    finish_reason="stop",
                    last_text=str(k),
                    reward=1.0 if k % 2 == 0 else None,
                )

    def overlong_lengths(self, samples: Sequence, max_len: int) -> OverlongLengths:
        return OverlongLengths(max_len=BUDGET, lengths=tuple(len(s.response_ids) for s in samples))


def test_a_generator_registered_here_runs_through_the_pipeline():
    generator = build_generator("test_counting", GeneratorSetup(sampling=SamplingSettings(), tokenizer=None))
    engine = FakeEngine()
    inputs = RolloutInputs(
        engine=engine,
        prompts=FakePrompts([f"p{i}" for i in range(4)], per_batch=2),
        generator=generator,
        reward_fn=lambda record, text: 0.25 * int(text),
        controller=FixedController(G),
        scoring=GroupScoring(overlong=OverlongShaping(max_len=100, buffer=1)),
    )
    settings = PipelineSettings(mode="sync", micro_batch_tokens=4096, poll_s=0.01, join_timeout_s=5.0)
    trainer = FakeTrainer(engine)
    with deadline(60), Pipeline(inputs, settings, StepSpan(start_step=5, num_steps=2)) as pipe:
        summaries = [train_one_step(pipe, trainer) for _ in range(2)]
    groups = [g for mb in trainer.micro_batches for g in mb.groups]
    assert [(g.step, g.prompt_id) for g in groups] == [(5, "p0"), (5, "p1"), (6, "p2"), (6, "p3")]
    batches = [(5, ("p0", "p1")), (6, ("p2", "p3"))]  # the engine runs version step - 5 (sync)
    assert generator.checked == [(f"{s}/{pid}/{k}", s - 5) for s, pids in batches for pid in pids for k in range(G)]
    for g in groups:
        assert [s.response_ids for s in g.samples] == [(3,), (4, 4), (5, 5, 5)]
        assert [s.request_id for s in g.samples] == [f"{g.step}/{g.prompt_id}/{k}" for k in range(G)]
        assert [s.reward for s in g.samples] == [1.0, 0.25, 1.0]  # environment, task (k=1), environment
        assert {s.weight_version for s in g.samples} == {g.step - 5}
        raw = torch.tensor([1.0, 0.25, 1.0])
        shaped = raw + overlong_reward_delta(torch.tensor([1, 2, 3]), max_len=BUDGET, buffer=1)
        torch.testing.assert_close(g.rewards, shaped)  # measured against the generator's budget
        assert not torch.equal(g.rewards, raw)
    assert [s.end.response_lengths for s in summaries] == [(1, 2, 3) * 2] * 2


class Tokenizer:
    def decode(self, ids, *, skip_special_tokens: bool) -> str:
        return " ".join(map(str, ids))


def test_the_built_in_generators_are_registered_and_names_are_checked():
    setup = GeneratorSetup(sampling=SamplingSettings(max_new_tokens=4), tokenizer=Tokenizer())
    assert isinstance(build_generator("single_turn", setup), SingleTurnGenerator)
    with pytest.raises(ValueError, match=r"unknown generator 'nope': registered are .*'multi_turn', 'single_turn'"):
        build_generator("nope", setup)
    with pytest.raises(ValueError, match="'single_turn' is already registered"):
        register_generator("single_turn")(CountingGenerator)


def test_a_generator_in_the_users_own_file_is_chosen_by_config(tmp_path):
    """``rollout.generator: "pkg.mod:factory"`` builds a generator no framework file names (this
    file's), the way ``environment.kind`` and ``reward.fn`` take dotted paths; ``auto`` follows
    ``environment.kind``."""
    from megatron_rl.config import load_config
    from megatron_rl.trainer import from_config
    from tests.test_config import MINIMAL, SMOLLM2

    path = tmp_path / "config.yaml"
    path.write_text(MINIMAL)
    dotted = "tests.test_generation_registry:CountingGenerator"
    cfg = load_config(path, [f"rollout.generator={dotted}"], hf_config=SMOLLM2)
    assert isinstance(from_config.generator(cfg, None, SamplingSettings()), CountingGenerator)
    auto = load_config(path, [], hf_config=SMOLLM2)
    assert auto.rollout.generator == "auto"
    assert isinstance(from_config.generator(auto, _Decoder(), SamplingSettings()), SingleTurnGenerator)
    with pytest.raises(ValueError, match=r"rollout.generator: 'tests.test_generation_registry:Nope': .*no attribute"):
        build_generator(
            "tests.test_generation_registry:Nope", GeneratorSetup(sampling=SamplingSettings(), tokenizer=None)
        )


class _Decoder:
    """The one tokenizer method the single-turn generator's factory binds."""

    def decode(self, ids, skip_special_tokens=True):
        return ""
