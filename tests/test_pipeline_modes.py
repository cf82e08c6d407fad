"""Pipeline modes end to end with a fake engine and trainer: sync vs periodic (same groups, other
order), on-policy versions, stale-mode bounds, dynamic sampling, controller feedback, budgets."""

from __future__ import annotations

import statistics

import pytest
import torch

from megatron_rl.control import FixedController, SAGCController, SAGCSettings
from megatron_rl.pipeline import request_seed
from tests.pipeline_fakes import (
    FakeEngine,
    FakePrompts,
    FakeTrainer,
    deadline,
    make_pipeline,
    producer_threads,
    sample_tokens,
    train_one_step,
)


def run(engine, steps=3, trainer_sleep=0.0, lead=None, **kw):
    trainer = FakeTrainer(engine, sleep_s=trainer_sleep, lead=None if lead is None else (lead, steps))
    with deadline(60), make_pipeline(engine, num_steps=steps, **kw) as pipe:
        reports = [train_one_step(pipe, trainer) for _ in range(steps)]
    assert not producer_threads()
    return trainer, reports


def trained_groups(trainer):
    return [g for mb in trainer.micro_batches for g in mb.groups]


def grpo_advantages(rewards):
    """Hand GRPO: (r - mean) / (unbiased std + 1e-6); all-equal groups get 0."""
    if len(set(rewards)) == 1:
        return [0.0] * len(rewards)
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


def completion_order(engine, step):
    """Prompt ids of ``step`` in the order their last sample left the engine."""
    remaining, order = {}, []
    for res in engine.results:
        s, pid, _ = res.request_id.split("/")
        if int(s) == step:
            remaining[pid] = remaining.get(pid, 0) + 1
            if remaining[pid] == 4:
                order.append(pid)
    return order


def test_periodic_trains_the_same_groups_as_sync_in_arrival_order():
    sync_engine, periodic_engine = FakeEngine(order_seed=1), FakeEngine(order_seed=2)
    sync, _ = run(sync_engine, mode="sync")
    periodic, _ = run(periodic_engine, mode="periodic", flush_when_idle=False)
    by_key = {(g.step, g.prompt_id): g for g in trained_groups(sync)}
    assert len(by_key) == 18 and {(g.step, g.prompt_id) for g in trained_groups(periodic)} == set(by_key)
    reordered = 0
    for step in range(3):
        sync_order = [g.prompt_id for g in trained_groups(sync) if g.step == step]
        periodic_order = [g.prompt_id for g in trained_groups(periodic) if g.step == step]
        assert sync_order == [f"p{(6 * step + j) % 12}" for j in range(6)]  # prompt order
        assert periodic_order == completion_order(periodic_engine, step)
        reordered += periodic_order != sync_order
    assert reordered >= 1
    for g in trained_groups(periodic):
        ref = by_key[(g.step, g.prompt_id)]
        assert [s.response_ids for s in g.samples] == [s.response_ids for s in ref.samples]
        assert torch.equal(g.advantages, ref.advantages)


def test_samples_follow_the_seed_and_advantages_are_grpo():
    engine = FakeEngine()
    trainer, _ = run(engine, steps=2)
    seeds = set()
    for g in trained_groups(trainer):
        for k, s in enumerate(g.samples):
            assert s.request_id == f"{g.step}/{g.prompt_id}/{k}" and s.index == k
            seed = request_seed(7, g.step, g.prompt_id, k)
            assert (s.response_ids, s.behav_logprobs) == sample_tokens(seed, s.weight_version)
            seeds.add(seed)
        rewards = [float(s.response_ids[0] % 2 == 0) for s in g.samples]
        assert [s.reward for s in g.samples] == rewards
        torch.testing.assert_close(g.advantages, torch.tensor(grpo_advantages(rewards)))
    assert len(seeds) == 2 * 6 * 4  # distinct per (step, prompt, k)


@pytest.mark.parametrize("mode", ["sync", "periodic"])
def test_on_policy_batches_carry_one_version(mode):
    engine = FakeEngine(version=5, delay_s=0.001)
    trainer, reports = run(engine, mode=mode, trainer_sleep=0.002)
    for g in trained_groups(trainer):
        assert {s.weight_version for s in g.samples} == {5 + g.step}
    assert engine.calls == [(0, 5), (1, 6), (2, 7)]  # generation of step t starts at version 5 + t
    assert engine.updates == [6, 7, 8] and [r.new_version for r in reports] == [6, 7, 8]
    assert all(r.staleness.max == 0 for r in reports)


@pytest.mark.parametrize("k", [1, 2])
def test_stale_mode_runs_ahead_within_the_bound(k):
    engine = FakeEngine(delay_s=0.0005)
    trainer, reports = run(engine, steps=5, mode="stale", max_staleness=k, lead=k)
    for step, version in engine.calls:
        assert version >= step - k  # generation of batch t starts at a version >= t - k
    assert max(step - version for step, version in engine.calls) == k  # it did run ahead
    for report in reports:
        step = report.step
        d = [step - s.weight_version for g in trained_groups(trainer) if g.step == step for s in g.samples]
        assert 0 <= min(d) and max(d) <= k
        st = report.staleness
        assert (st.num_samples, st.min, st.max) == (len(d), min(d), max(d))
        assert st.mean == pytest.approx(sum(d) / len(d))
    for mb in trainer.micro_batches:
        assert torch.equal(
            mb.staleness, mb.step - torch.tensor([s.weight_version for g in mb.groups for s in g.samples])
        )


def test_dynamic_sampling_drops_equal_groups_before_the_trainer():
    engine = FakeEngine()
    prompts = FakePrompts(["const0", "p1", "p2", "const3", "p4", "p5"], per_batch=6)
    trainer, reports = run(engine, prompts=prompts, dynamic_sampling=True)
    for step, report in enumerate(reports):
        rewards = {}
        for res in engine.results:
            s, pid, _ = res.request_id.split("/")
            if int(s) == step:
                r = 0.5 if pid.startswith("const") else float(res.response_ids[0] % 2 == 0)
                rewards.setdefault(pid, []).append(r)
        varied = {pid for pid, r in rewards.items() if len(set(r)) > 1}
        assert {g.prompt_id for g in trained_groups(trainer) if g.step == step} == varied
        assert report.end.groups_dropped == 6 - len(varied) >= 2
        assert report.trained_groups == len(varied)
        assert report.reward_mean == pytest.approx(sum(map(sum, rewards.values())) / 24)


class ScriptedController(FixedController):
    """Chooses G from a script and records every observe call."""

    def __init__(self, sizes):
        super().__init__(4)
        self.sizes, self.observed = list(sizes), []

    def choose(self):
        return self.sizes[len(self.observed)]

    def observe(self, response_lengths):
        self.observed.append(list(response_lengths))
        return super().observe(response_lengths)


def expected_lengths(engine, step, prompt_ids, group_size):
    length = {r.request_id: len(r.response_ids) for r in engine.results}
    return [length[f"{step}/{p}/{k}"] for p in prompt_ids for k in range(group_size)]


def test_controller_observes_each_batch_once_with_its_lengths():
    engine, controller = FakeEngine(), ScriptedController([2, 5, 3])
    prompts = FakePrompts(["const0"] + [f"p{i}" for i in range(1, 6)], per_batch=6)
    trainer, reports = run(engine, prompts=prompts, controller=controller, dynamic_sampling=True)
    ids = [it.record.prompt_id for it in prompts.items]
    assert len(controller.observed) == 3
    for step, size in enumerate([2, 5, 3]):
        assert controller.observed[step] == expected_lengths(engine, step, ids, size)  # dropped groups included
        assert all(g.group_size == size for g in trained_groups(trainer) if g.step == step)
        assert reports[step].end.group_size == size


def test_sagc_controller_is_fed_like_a_standalone_one():
    settings = SAGCSettings(candidates=(2, 3, 4), initial=3, tau=1.5, seed=3)
    engine, controller, mirror = FakeEngine(), SAGCController(settings), SAGCController(settings)
    prompts = FakePrompts([f"p{i}" for i in range(6)], per_batch=6)
    run(engine, steps=4, prompts=prompts, controller=controller)
    ids = [f"p{i}" for i in range(6)]
    for step in range(4):
        size = mirror.choose()
        mirror.observe(expected_lengths(engine, step, ids, size))
    assert controller.state_dict() == mirror.state_dict()


def test_micro_batches_respect_the_token_budget():
    engine = FakeEngine()
    trainer, reports = run(engine, mode="periodic", tokens=40, flush_when_idle=False)
    for step in range(3):
        mbs = [mb for mb in trainer.micro_batches if mb.step == step]
        assert reports[step].num_micro_batches == len(mbs) >= 2
        for a, b in zip(mbs, mbs[1:], strict=False):
            assert a.packed.num_tokens <= 40 < a.packed.num_tokens + b.groups[0].num_packed_tokens
        tokens = sum(len(s.response_ids) for mb in mbs for g in mb.groups for s in g.samples)
        assert reports[step].trained_response_tokens == tokens


def test_a_group_over_the_budget_raises_and_shuts_down():
    engine = FakeEngine()
    with deadline(30), pytest.raises(ValueError, match="micro_batch_tokens=5"):
        run(engine, tokens=5)
    assert not producer_threads() and engine.shutdown_calls == 1
