"""The mismatch alarm in the real training loop (tiny model, hf engine in its own process).

An engine whose weights are deliberately one version behind (it acknowledges version v but
loads the snapshot of v − 1) makes ``algorithm.mismatch_alarm`` with ``action: stop`` raise
before the optimizer step of the first batch it samples with stale weights; the same run with
a correctly synced engine logs ``mismatch/…`` metrics at fp32 round-off and trains through.
In ``stale`` mode the loss measures nothing in steady state (every sample is d >= 1 old): the
engine probe (``trainer.engine_probe``) catches the same engine at the first sync, and logs
``mismatch_probe/…`` at round-off every step with a synced one.
"""

from __future__ import annotations

import pytest

from megatron_rl.rollout.engine_wrapper import EngineWrapper
from tests.distributed import run_distributed
from tests.rl_fixtures import TRAIN_PLATFORM, lead_holding_factory, make_tiny_rl_model, tiny_rl_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ALARM = ["algorithm.mismatch_alarm.logprob_abs_diff_mean=1e-4", "algorithm.mismatch_alarm.action=stop"]


class OneVersionBehindEngine(EngineWrapper):
    """Wraps a real engine; ``load_weights(snapshot_v, v)`` loads the previous snapshot (the
    checkpoint's weights for v = 1) while reporting version v: weights not synced, labels fine
    (it generates and scores with them)."""

    def __init__(self, inner, initial: str) -> None:
        super().__init__(inner)
        self.previous = initial

    def load_weights(self, update, version: int) -> None:
        from megatron_rl.weight_sync.snapshot import SnapshotUpdate

        if not isinstance(update, SnapshotUpdate):
            raise NotImplementedError("this test uses rollout.weight_sync=snapshot")
        self.inner.load_weights(SnapshotUpdate(self.previous), version)
        self.previous = update.path


def _behind_factory(settings):
    from megatron_rl.rollout import build_engine

    return OneVersionBehindEngine(build_engine(settings), settings.model_path)


def _train(config_path: str, overrides: list[str], behind: bool, whole_batch_ahead: bool = False):
    """A rank's body: ("stopped", message) if the alarm stopped the run, else ("done", history).
    ``whole_batch_ahead``: stale mode samples each next batch whole before the trainer syncs."""
    from megatron_rl.algorithms import MismatchAlarmError
    from megatron_rl.config import load_config
    from megatron_rl.trainer.loop import train

    if behind:  # the wrapper replays snapshots one version late
        overrides = [*overrides, "rollout.weight_sync=snapshot"]
    cfg = load_config(config_path, overrides)
    factory = _behind_factory if behind else None
    if whole_batch_ahead:
        factory = lead_holding_factory(cfg, cfg.pipeline.max_staleness, whole_batch=True)
    try:
        history = train(cfg, platform=TRAIN_PLATFORM, engine_factory=factory)
    except MismatchAlarmError as e:
        return "stopped", str(e)
    return "done", history


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mismatch_loop")
    model = make_tiny_rl_model(tmp / "model")
    return str(
        tiny_rl_config(
            tmp,
            model,
            reward={"fn": "tests.rl_fixtures:digit_share_reward"},
            trainer={"steps": 3, "prompts_per_batch": 3, "lr": 1e-2, "adam_eps": 1e-3},
        )
    )


def test_engine_one_version_behind_makes_the_alarm_stop_the_run(config):
    ((status, message),) = run_distributed(_train, 1, config, [*ALARM, "pipeline.mode=sync"], True, timeout_s=900)
    assert status == "stopped", "the stale engine went unnoticed"
    assert "mismatch/logprob_abs_diff_mean" in message and "before the optimizer step" in message
    assert "weights not synced" in message


DECOUPLED_2_STEPS = [
    "algorithm.loss=ppo_decoupled",
    "algorithm.proximal=loglinear",
    "trainer.mini_batches=2",
    "trainer.prompts_per_batch=4",
]
SYNCED = {
    "grpo": [],
    # A-3PO runs no old copy; after the first optimizer step the policy has drifted from θ_t (lr 1e-2),
    # so the engine must be compared with θ_t: the old copy kept for the mask, or the first mini-batch only.
    "a3po_2_steps_token_mask": [
        *DECOUPLED_2_STEPS,
        "algorithm.rollout_correction.mode=token_mask",
        "algorithm.rollout_correction.c_min=0.5",
        "algorithm.rollout_correction.c_max=2.0",
    ],
    "a3po_2_steps_measure_only": DECOUPLED_2_STEPS,
}


@pytest.mark.parametrize("variant", list(SYNCED))
def test_synced_engine_logs_round_off_mismatch_and_trains_through(config, variant):
    ((status, history),) = run_distributed(
        _train, 1, config, [*ALARM, "pipeline.mode=sync", *SYNCED[variant]], False, timeout_s=900
    )
    assert status == "done" and len(history) == 3
    for h in history:
        assert h["mismatch/logprob_abs_diff_mean"] <= 1e-5
        assert h["mismatch/masked_fraction"] == 0.0
        assert h["mismatch/seq_ratio_max"] == pytest.approx(1.0, abs=1e-3)


STALE = [
    "pipeline.mode=stale",
    "pipeline.max_staleness=1",
    "pipeline.queue_size=16",
    "algorithm.loss=ppo_decoupled",
    "algorithm.proximal=loglinear",
]


def test_stale_mode_engine_one_version_behind_is_caught_by_the_probe_at_the_first_sync(config):
    ((status, message),) = run_distributed(_train, 1, config, [*ALARM, *STALE], True, timeout_s=900)
    assert status == "stopped", "the stale engine went unnoticed in stale mode"
    assert "mismatch/logprob_abs_diff_mean" in message and "weights not synced" in message
    assert "engine probe right after the sync of version 1" in message  # within the first step


def test_stale_mode_synced_engine_probe_logs_round_off_every_step(config):
    """At PP = 2: rank 0 (first stage) scores on the engines, the last stage compares, rank 0 logs."""
    (status, history), _ = run_distributed(
        _train, 2, config, [*ALARM, *STALE, "parallel.pp=2"], False, True, timeout_s=900
    )
    assert status == "done" and len(history) == 3
    for h in history:
        assert h["mismatch_probe/n_tokens"] > 0 and h["probe/sequences"] == 4
        assert h["mismatch_probe/logprob_abs_diff_mean"] <= 1e-5 and h["time/probe_s"] > 0
    steady = [h for h in history if h["rollout/staleness_mean"] >= 1]
    assert steady, "no step with only stale samples"
    for h in steady:  # the loss measured nothing: n_tokens 0, no other mismatch/ metric
        assert h["mismatch/n_tokens"] == 0 and "mismatch/kl_k3" not in h
