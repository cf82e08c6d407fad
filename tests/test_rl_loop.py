"""End-to-end RL loop on a tiny model with the real hf engine in its own process.

On-policy equivalence (DESIGN §1): with seeded sampling, ``periodic`` mode — groups trained
as they arrive, here in a shuffled completion order — ends with the same parameters after
3 optimizer steps as the ``sync`` loop, at TP=1 and TP=2; every sample of a batch carries
the batch's weight version.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.rl_fixtures import make_tiny_rl_model, tiny_rl_config


def _shuffled_factory(settings):
    from megatron_rl.rollout import build_engine
    from tests.rl_fixtures import ShuffledEngine

    return ShuffledEngine(build_engine(settings), seed=11)


def _train_worker(config_path: str, overrides: list[str]):
    from megatron_rl.config import load_config
    from megatron_rl.trainer.loop import train

    cfg = load_config(config_path, overrides)
    return train(cfg, platform="cpu", engine_factory=_shuffled_factory)


def _final_weights(path):
    from safetensors.torch import load_file

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl")
    model = make_tiny_rl_model(tmp / "model")
    config = tiny_rl_config(tmp, model, reward={"fn": "tests.rl_fixtures:digit_share_reward"},
                            trainer={"steps": 3, "prompts_per_batch": 3, "lr": 1e-2, "adam_eps": 1e-3})
    return tmp, str(config)


def _run(tmp, config, name, world, overrides):
    out = tmp / name
    histories = run_distributed(_train_worker, world, config, [*overrides, f"trainer.save_dir={out}"], timeout_s=600)
    return _final_weights(out / "step_3" / "model"), histories[0]


@pytest.mark.parametrize("tp", [1, 2])
def test_periodic_equals_sync_after_three_steps(setup, tp):
    tmp, config = setup
    base = [f"parallel.tp={tp}"]
    sync, sync_hist = _run(tmp, config, f"sync_tp{tp}", tp, [*base, "pipeline.mode=sync"])
    periodic, periodic_hist = _run(tmp, config, f"periodic_tp{tp}", tp, [*base, "pipeline.mode=periodic",
                                                                      "rollout.max_batch_size=4"])
    initial = _final_weights(tmp / "model")
    assert max((sync[k] - initial[k]).abs().max().item() for k in initial) > 1e-4, "training did not move"
    for key, value in sync.items():
        rel = (periodic[key] - value).abs().max() / value.abs().max()
        assert rel <= 1e-6, f"{key}: periodic differs from sync by {rel:.2e} (relative)"
    for hist in (sync_hist, periodic_hist):
        assert [h["train/version"] for h in hist] == [1.0, 2.0, 3.0]
        assert all(h["rollout/staleness_max"] == 0 for h in hist)  # every sample carries the batch version
    assert any(h["loss/value"] != 0 for h in sync_hist)
    assert torch.isfinite(torch.tensor([h["loss/value"] for h in periodic_hist])).all()


def _stale_worker(config_path: str, overrides: list[str]):
    from megatron_rl.config import load_config
    from megatron_rl.trainer.loop import train

    return train(load_config(config_path, overrides), platform="cpu")


def test_stale_mode_runs_ahead_within_the_bound(setup):
    """stale + A-3PO: generation of batch t+1 overlaps the update of batch t; samples are at most
    max_staleness versions old, the weight update waits for the generate call in progress."""
    tmp, config = setup
    overrides = ["pipeline.mode=stale", "pipeline.max_staleness=1", "algorithm.loss=ppo_decoupled",
                 "algorithm.proximal=loglinear", "trainer.steps=4"]
    (history,) = run_distributed(_stale_worker, 1, config, overrides, timeout_s=600)
    assert [h["train/version"] for h in history] == [1.0, 2.0, 3.0, 4.0]
    staleness = [h["rollout/staleness_max"] for h in history]
    assert max(staleness) <= 1
    assert all(torch.isfinite(torch.tensor(h["loss/value"])) for h in history)


def test_resume_from_a_checkpoint_continues_exactly(setup):
    """3 steps straight == 1 step, checkpoint (weights, Adam state, controller, prompt stream),
    a new process resuming for the remaining 2 steps."""
    tmp, config = setup
    straight, resumed = tmp / "straight", tmp / "resumed"
    run_distributed(_stale_worker, 1, config, ["pipeline.mode=sync", "trainer.save_every=1",
                                               f"trainer.save_dir={straight}"], timeout_s=600)
    assert (straight / "step_1" / "trainer_state.json").is_file()
    assert not list(straight.glob("*.tmp")), "a staging directory was left behind"
    (history,) = run_distributed(_stale_worker, 1, config, ["pipeline.mode=sync", f"trainer.save_dir={resumed}",
                                                            f"trainer.resume_from={straight / 'step_1'}"],
                                 timeout_s=600)
    assert len(history) == 2
    expected, got = _final_weights(straight / "step_3" / "model"), _final_weights(resumed / "step_3" / "model")
    for key, value in expected.items():
        rel = (got[key] - value).abs().max() / value.abs().max()
        assert rel <= 1e-6, f"{key}: resumed run differs by {rel:.2e} (relative)"


def test_broadcast_weight_sync_equals_snapshot_sync(setup):
    """rollout.weight_sync=broadcast (trainer leader -> engine workers over a gloo group, the
    NCCL / HCCL path on devices) trains exactly like the snapshot path, at TP=2."""
    tmp, config = setup
    base = ["parallel.tp=2", "pipeline.mode=periodic"]
    snapshot, _ = _run(tmp, config, "sync_snapshot_tp2", 2, [*base, "rollout.weight_sync=snapshot"])
    broadcast, hist = _run(tmp, config, "sync_broadcast_tp2", 2, [*base, "rollout.weight_sync=broadcast"])
    assert [h["train/version"] for h in hist] == [1.0, 2.0, 3.0]
    for key, value in snapshot.items():
        rel = (broadcast[key] - value).abs().max() / value.abs().max()
        assert rel <= 1e-6, f"{key}: broadcast sync differs from snapshot sync by {rel:.2e}"
