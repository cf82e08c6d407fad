"""Mini-batches by prompt order, groups split across micro-batches, and the group-size controller
fed by the producer (stale + SAGC), with the fake engine and trainer of ``pipeline_fakes``."""

from __future__ import annotations

import pytest

from megatron_rl.control import SAGCController, SAGCSettings
from tests.pipeline_fakes import FakeEngine, FakePrompts, FakeTrainer, deadline, make_pipeline, train_one_step

PROMPTS = [f"p{i}" for i in range(12)]


def run(engine, steps=3, lead=None, **kw):
    trainer = FakeTrainer(engine, lead=None if lead is None else (lead, steps))
    with deadline(60), make_pipeline(engine, num_steps=steps, **kw) as pipe:
        summaries = [train_one_step(pipe, trainer) for _ in range(steps)]
    return trainer, summaries


class RecordingSAGC(SAGCController):
    """SAGC that logs every choose / observe call in order."""

    def __init__(self, settings):
        super().__init__(settings)
        self.calls = []

    def choose(self):
        g = super().choose()
        self.calls.append(("choose", g))
        return g

    def observe(self, response_lengths):
        self.calls.append(("observe", list(response_lengths)))
        return super().observe(response_lengths)


@pytest.mark.parametrize("k", [1, 2])
def test_stale_sagc_credits_every_observation_to_the_g_that_produced_it(k):
    settings = SAGCSettings(candidates=(2, 3, 4), initial=3, tau=1.5, delta=0.3, eta=1.0, seed=1)
    controller, engine = RecordingSAGC(settings), FakeEngine(delay_s=0.0002)
    prompts = FakePrompts(PROMPTS[:6], per_batch=6)
    trainer, summaries = run(
        engine, steps=10, mode="stale", max_staleness=k, controller=controller, prompts=prompts, lead=k
    )
    kinds = [kind for kind, _ in controller.calls]
    assert kinds == ["choose", "observe"] * 10  # strictly alternating: batch t observed before t+1 is chosen
    length = {r.request_id: len(r.response_ids) for r in engine.results}
    for step in range(10):
        g, observed = controller.calls[2 * step][1], controller.calls[2 * step + 1][1]
        assert len(observed) == 6 * g and summaries[step].end.group_size == g
        assert observed == [length[f"{step}/{p}/{j}"] for p in PROMPTS[:6] for j in range(g)]
        assert summaries[step].end.control_metrics["control/group_size"] == g
    assert len({g for kind, g in controller.calls if kind == "choose"}) > 1, "SAGC never moved"
    assert max(s.staleness.max for s in summaries) == k  # it did run ahead
    assert controller.calls[0] == ("choose", 3)  # the configured G first


def mini_batch_of(group, prompts_per_batch, m):
    return group.prompt_index // (prompts_per_batch // m)


@pytest.mark.parametrize("mode", ["sync", "periodic"])
@pytest.mark.parametrize("m, tokens", [(2, 4096), (3, 4096), (2, 30)])
def test_mini_batches_follow_prompt_order_and_step_exactly_m_times(mode, m, tokens):
    engine = FakeEngine(order_seed=3, delay_s=0.0002)
    trainer, summaries = run(engine, mode=mode, mini_batches=m, tokens=tokens)
    assert len(trainer.steps) == 3 * m  # m optimizer steps per batch, whatever the packing
    bounds = [0, *trainer.steps]
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        step, j = divmod(s, m)
        groups = [g for mb in trainer.micro_batches[lo:hi] for g in mb.groups]
        assert {g.step for g in groups} == {step}
        assert {mini_batch_of(g, 6, m) for g in groups} == {j}
        assert {g.prompt_id for g in groups} == {f"p{(6 * step + p) % 12}" for p in range(6) if p // (6 // m) == j}
        assert all(mb.mini_batch == j for mb in trainer.micro_batches[lo:hi])


def test_all_groups_in_one_micro_batch_still_give_m_steps():
    """4 groups fit one micro-batch; with mini_batches=2 that is still 2 optimizer steps, each on its half."""
    engine = FakeEngine()
    prompts = FakePrompts(PROMPTS[:4], per_batch=4)
    trainer, _ = run(engine, steps=1, mode="sync", mini_batches=2, prompts=prompts)
    assert trainer.steps == [1, 2]
    assert [sorted(g.prompt_index for g in mb.groups) for mb in trainer.micro_batches] == [[0, 1], [2, 3]]


def test_periodic_keeps_later_mini_batches_until_their_step():
    """Mini-batch 1 must see the weights after mini-batch 0's step: an early arrival waits."""
    engine = FakeEngine(order_seed=5)
    trainer, summaries = run(engine, mode="periodic", mini_batches=2, flush_when_idle=True)
    for step in range(3):
        order = [r.request_id.split("/")[1] for r in engine.results if r.request_id.startswith(f"{step}/")]
        finished = [p for i, p in enumerate(order) if order[i + 1 :].count(p) == 0]  # last sample of each group
        trained = [g.prompt_id for mb in trainer.micro_batches if mb.step == step for g in mb.groups]
        first_half = {f"p{(6 * step + p) % 12}" for p in range(3)}
        assert trained[:3] and set(trained[:3]) == first_half
        assert [p for p in finished if p in first_half] == trained[:3]  # arrival order inside the mini-batch
        assert summaries[step].num_micro_batches == len([mb for mb in trainer.micro_batches if mb.step == step])


def test_a_mini_batch_dropped_entirely_still_ends_with_a_step():
    engine = FakeEngine()
    prompts = FakePrompts(["const0", "const1", "const2", "p3", "p4", "p5"], per_batch=6)
    trainer, _ = run(engine, steps=1, mini_batches=2, dynamic_sampling=True, prompts=prompts)
    assert trainer.steps == [0, len(trainer.micro_batches)]  # the first step had nothing to train


@pytest.mark.parametrize("mode", ["sync", "periodic"])
def test_a_group_over_the_budget_is_split_into_parts_sharing_its_prompt(mode):
    engine = FakeEngine()
    trainer, summaries = run(engine, mode=mode, tokens=9)
    trained = {}
    for mb in trainer.micro_batches:
        assert mb.packed.num_tokens <= 9
        for part in mb.groups:
            for s, adv in zip(part.samples, part.advantages.tolist(), strict=True):
                assert s.request_id not in trained, "a sample was trained twice"
                trained[s.request_id] = (s.prompt_ids, adv)
    assert len(trained) == 3 * 6 * 4
    assert any(len(mb.groups[0].samples) < 4 for mb in trainer.micro_batches), "no group was split"
    assert all(s.num_micro_batches > 6 for s in summaries)
