"""Expert parallelism with uneven batches (issue 29, defect 4): the replicas of an EP group run
the same number of micro-batches per optimizer step, and the engine probe runs on every replica.

The EP groups span DP replicas and every MoE layer runs EP collectives (megatron's all-to-all
token dispatcher), so a replica with one more micro-batch than its peers waited inside an MoE
forward for peers already in the optimizer step: no step completed. ``BatchCutting(lockstep=True)``
(``parallel.ep`` > 1) sends micro-batches in rounds, one per replica, and pads a short replica
with ``padding_micro_batch`` (two tokens, loss mask 0).

- Fakes (no process): at 2-4 replicas, in sync, periodic and stale mode, 1 and 2 mini-batches,
  3-6 prompts (so some replica gets more micro-batches, or none): every round holds one
  micro-batch per replica, replica 0 last; every real sample is trained once; padding counts
  as ``train/padding_micro_batches``; without lockstep nothing is padded.
- One world of 4 ranks, tiny Qwen3-MoE, emulated device, ``parallel.timeout_s`` 60 (a hang
  fails there instead of blocking): (1) a padding micro-batch adds exactly zero to the
  gradient, the loss and its denominator (router losses on; DP 4 x EP 2, every rank pads);
  (2) RL runs of 3 prompts per batch: sync at PP 2 x DP 2 x EP 2, the same at EP 1 (the
  reference: no padding), periodic at DP 4 x EP 2 (one replica gets no group), stale at
  PP 2 x DP 2 x EP 2 with the engine probe on (its default there). Each finishes its steps;
  sync at EP 2 and periodic at DP 4 x EP 2 end with the reference's weights (<= 1e-5), grad
  norms and loss metrics (the weights alone would not see a wrong denominator: Adam).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from megatron_rl.pipeline.batching import is_padding, padding_micro_batch
from megatron_rl.pipeline.records import MicroBatch
from tests.distributed import run_distributed
from tests.pipeline_fakes import FakeEngine, FakePrompts, FakeTrainer, deadline, make_pipeline, train_one_step
from tests.rl_fixtures import TRAIN_PLATFORM, load_weights, tiny_rl_config
from tests.test_data_parallel import assert_same_loss_metrics

WEIGHT_TOL = 1e-5  # fp32: the experts' sums run in another order at EP 2 than at EP 1


# ---- the plan (fakes, no process) ------------------------------------------------------------


def _lockstep_run(mode: str, replicas: int, *, prompts: int, mini_batches: int, lockstep: bool = True):
    engine = FakeEngine(order_seed=5, delay_s=0.0002)
    trainer = FakeTrainer(engine)
    pipe = make_pipeline(
        engine,
        mode=mode,
        max_staleness=1 if mode == "stale" else 0,
        tokens=20,
        prompts=FakePrompts([f"p{i}" for i in range(12)], per_batch=prompts),
        mini_batches=mini_batches,
    )
    pipe._replicas = replicas  # what build_run passes as Pipeline(replicas=layout.dp)
    pipe.settings = dataclasses.replace(pipe.settings, lockstep_replicas=lockstep)  # from_config: parallel.ep > 1
    with deadline(60), pipe:
        summaries = [train_one_step(pipe, trainer) for _ in range(3)]
    return trainer, summaries


def _per_optimizer_step(trainer: FakeTrainer) -> list[list[MicroBatch]]:
    bounds = [0, *trainer.steps]
    return [trainer.micro_batches[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("mode", ["sync", "periodic", "stale"])
@pytest.mark.parametrize(("replicas", "prompts", "mini_batches"), [(2, 3, 1), (3, 6, 2), (4, 6, 2)])
def test_lockstep_replicas_train_equal_rounds(mode, replicas, prompts, mini_batches):
    trainer, summaries = _lockstep_run(mode, replicas, prompts=prompts, mini_batches=mini_batches)
    padded = 0
    for mbs in _per_optimizer_step(trainer):
        assert len(mbs) % replicas == 0, [mb.replica for mb in mbs]
        for k in range(0, len(mbs), replicas):  # a round: one per replica, replica 0 (rank 0's own) last
            assert [mb.replica for mb in mbs[k : k + replicas]] == list(reversed(range(replicas)))
        assert len({mb.mini_batch for mb in mbs}) == 1
        for mb in filter(is_padding, mbs):
            assert mb.packed.num_tokens == 2 and mb.advantages.abs().sum() == 0
            assert not mb.loss_mask.any() and mb.policy_version == mbs[0].policy_version
        padded += sum(map(is_padding, mbs))
    assert padded > 0, "the batches were even: nothing tested"
    assert sum(s.extra_metrics["train/padding_micro_batches"] for s in summaries) == padded
    trained = [s.request_id for mb in trainer.micro_batches if not is_padding(mb) for g in mb.groups for s in g.samples]
    assert len(trained) == len(set(trained)) == 3 * prompts * 4  # every real sample once
    assert sum(s.num_micro_batches for s in summaries) == len(trainer.micro_batches) - padded


def test_without_lockstep_nothing_is_padded():
    trainer, summaries = _lockstep_run("periodic", 2, prompts=3, mini_batches=1, lockstep=False)
    assert not any(map(is_padding, trainer.micro_batches))
    assert all("train/padding_micro_batches" not in s.extra_metrics for s in summaries)
    counts = [
        [mb.replica for mb in mbs].count(0) - [mb.replica for mb in mbs].count(1)
        for mbs in _per_optimizer_step(trainer)
    ]
    assert any(counts), "uneven batches expected: the lockstep cases above would test nothing"


def test_padding_micro_batch_keeps_routes_and_trains_nothing():
    from megatron_rl.pipeline.records import make_micro_batch
    from megatron_rl.rollout.types import RoutedExperts
    from tests.test_policy_trainer import make_groups

    real = make_groups(50, masked=True)[2]
    s = real.samples[0]
    routes = RoutedExperts(
        indices=np.arange(len(s.prompt_ids) + len(s.response_ids) - 1).repeat(6).reshape(-1, 3, 2).astype(np.int16)
    )
    group = dataclasses.replace(real, samples=(dataclasses.replace(s, routed_experts=routes),))
    mb = padding_micro_batch(group, policy_version=4, mini_batch=1, replica=3)
    assert (mb.policy_version, mb.mini_batch, mb.replica, mb.step) == (4, 1, 3, group.step)
    assert mb.packed.token_ids.tolist() == [s.prompt_ids[0], s.response_ids[0]]
    assert mb.loss_mask.tolist() == [False] and mb.advantages.tolist() == [0.0] and is_padding(mb)
    assert mb.packed.routed_experts.shape == (2, 3, 2)  # the one forwarded token's route, repeated
    assert torch.equal(mb.packed.routed_experts[0], torch.from_numpy(routes.indices[0]))
    assert not is_padding(dataclasses.replace(mb, loss_mask=torch.tensor([True])))
    assert not is_padding(make_micro_batch([real], policy_version=0))  # multi-turn masks: some token counts


def test_bench_train_scope_pads_as_training_does(tmp_path):
    """``bench --scope train`` cuts its synthetic steps with training's lockstep at EP > 1, and
    counts no padding as trained tokens."""
    from megatron_rl.bench import BenchOptions, LengthDist
    from megatron_rl.bench.train_scope import ShapeRecorder, SyntheticGroups, SyntheticSteps
    from megatron_rl.config import load_config
    from megatron_rl.models.synthetic import write_char_moe

    model = write_char_moe(tmp_path / "model")
    config = tiny_rl_config(tmp_path, model, trainer={"prompts_per_batch": 3})
    cfg = load_config(config, ["parallel.ep=2", "data.max_prompt_tokens=40", "pipeline.micro_batch_tokens=60"])
    opts = BenchOptions(
        scope="train", prompt_len=LengthDist(kind="fixed", a=16), response_len=LengthDist(kind="fixed", a=8)
    )
    steps = SyntheticSteps(cfg, SyntheticGroups.from_config(cfg, opts, 50), replicas=2)
    steps.prepare()
    mbs = [mb for mini in steps.begin_step().mini_batches() for mb in mini]
    assert [mb.replica for mb in mbs] == [1, 0, 1, 0] and sum(map(is_padding, mbs)) == 1  # 48-token groups
    leader = type("Leader", (), {"dispatch": None, "train_micro_batch": lambda self, mb: None})()
    recorder = ShapeRecorder(leader)
    for mb in mbs:
        recorder.train_micro_batch(mb)
    assert [(g.prompt_len, g.response_lens) for g in recorder.pop_shapes()] == [(16, (8,) * 4)] * 3


# ---- one world of 4 ranks --------------------------------------------------------------------

COMMON = ["parallel.timeout_s=60", "pipeline.micro_batch_tokens=240", "trainer.steps=2"]
STALE = ["pipeline.mode=stale", "pipeline.max_staleness=1", "algorithm.loss=ppo_decoupled"]
RUNS = {  # name: overrides; 3 prompts per batch over 2 or 4 replicas
    "sync_pp2_dp2_ep2": ["pipeline.mode=sync", "parallel.pp=2", "parallel.ep=2"],
    "sync_pp2_dp2_ep1": ["pipeline.mode=sync", "parallel.pp=2"],  # the reference: no padding
    "periodic_dp4_ep2": ["pipeline.mode=periodic", "parallel.ep=2"],  # one replica gets no group
    "stale_pp2_dp2_ep2": [*STALE, "parallel.pp=2", "parallel.ep=2"],  # + the engine probe (on by default)
}


def _padding_adds_zero(path) -> dict:
    """DP 4 x EP 2, router losses on: each rank trains one group, then the same with a padding
    micro-batch first on every rank; both gradients (``main_grad``) and results, as found."""
    from megatron_rl.pipeline.records import make_micro_batch
    from megatron_rl.trainer.build import build_policy_trainer
    from tests.test_moe_training import _settings
    from tests.test_policy_trainer import make_groups

    out = {}
    for pad in (False, True):
        trainer, policy, spec = build_policy_trainer(_settings(path, dict(kind="grpo"), aux=0.2, z=0.05, ep=2))
        group = make_groups(spec.vocab_size)[torch.distributed.get_rank()]
        grads = {}

        def record(grads=grads, policy=policy):  # the gradient the optimizer would apply
            grads.update({n: p.main_grad.detach().cpu().clone() for n, p in policy.named_parameters()})
            return True, 0.0, None

        trainer.optimizer.step = record
        trainer.begin_batch()
        if pad:
            trainer.train_micro_batch(padding_micro_batch(group, policy_version=0, mini_batch=0, replica=0))
        trainer.train_micro_batch(make_micro_batch([group], policy_version=0))
        result = trainer.finish_mini_batch()
        out[pad] = dict(grads=grads, loss=result.loss, denominator=result.denominator)
    return out


def _world(model, config, out):
    from megatron_rl.config import load_config
    from megatron_rl.parallel.state import destroy_parallel, initialize_parallel
    from megatron_rl.trainer.loop import train

    initialize_parallel(tp=1, pp=1, ep=2, platform=TRAIN_PLATFORM, timeout_s=60)
    results = {"zero": _padding_adds_zero(model)}
    destroy_parallel(keep_world=True)
    for name, overrides in RUNS.items():
        start = time.perf_counter()
        cfg = load_config(config, [*COMMON, *overrides, f"trainer.save_dir={out / name}"])
        results[name] = (train(cfg, platform=TRAIN_PLATFORM), time.perf_counter() - start)
        destroy_parallel(keep_world=True)
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from megatron_rl.models.synthetic import write_char_moe

    tmp = tmp_path_factory.mktemp("ep_uneven")
    model = write_char_moe(tmp / "model", seed=1)
    config = tiny_rl_config(
        tmp, model, reward={"fn": "tests.rl_fixtures:digit_share_reward"}, trainer={"prompts_per_batch": 3}
    )
    start = time.perf_counter()
    ranks = run_distributed(_world, 4, model, str(config), tmp, timeout_s=900)
    print(
        f"world of 4: {time.perf_counter() - start:.1f} s; per run (rank 0): "
        f"{ {k: round(v[1], 1) for k, v in ranks[0].items() if k != 'zero'} }"
    )
    return tmp, ranks


@pytest.mark.multiproc
@pytest.mark.slow
def test_padding_micro_batch_adds_exactly_zero(world):
    _, ranks = world
    for rank in ranks:
        plain, padded = rank["zero"][False], rank["zero"][True]
        assert plain["denominator"] == padded["denominator"] > 0 and plain["loss"] == padded["loss"]
        assert plain["grads"].keys() == padded["grads"].keys()
        assert any(n.endswith("router.weight") for n in plain["grads"])
        for name, grad in plain["grads"].items():
            assert torch.equal(grad, padded["grads"][name]), name


@pytest.mark.multiproc
@pytest.mark.slow
def test_uneven_ep_batches_finish_in_every_mode(world):
    tmp, ranks = world
    runs = {name: ranks[0][name][0] for name in RUNS}
    for name, history in runs.items():
        assert [h["train/version"] for h in history] == [1.0, 2.0], name
    padded = {name: sum(h.get("train/padding_micro_batches", 0.0) for h in history) for name, history in runs.items()}
    print(f"padding micro-batches per run: {padded}")
    assert all(padded[name] > 0 for name in RUNS if "ep2" in name), padded  # the batches were uneven
    assert "train/padding_micro_batches" not in runs["sync_pp2_dp2_ep1"][0]
    probed = [h for h in runs["stale_pp2_dp2_ep2"] if "mismatch_probe/n_tokens" in h]
    assert probed and all(h["mismatch_probe/n_tokens"] > 0 for h in probed)
    reference = load_weights(tmp / "sync_pp2_dp2_ep1" / "step_2" / "model")
    for name in ("sync_pp2_dp2_ep2", "periodic_dp4_ep2"):
        got = load_weights(tmp / name / "step_2" / "model")
        diff = max((got[k] - reference[k]).abs().max().item() for k in reference)
        print(f"{name}: max |weight - EP 1 reference| {diff:.2e}")
        assert diff <= WEIGHT_TOL, name
        # Adam hides a gradient's scale: the norm and the loss metrics see the denominator
        assert_same_loss_metrics(runs[name], runs["sync_pp2_dp2_ep1"])
        for h, ref in zip(runs[name], runs["sync_pp2_dp2_ep1"], strict=True):
            assert h["loss/grad_norm"] == pytest.approx(ref["loss/grad_norm"], rel=1e-4), name
