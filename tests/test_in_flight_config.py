"""``rollout.in_flight_updates``: off by default; check-config accepts it in stale mode and refuses it,
naming the key, where it cannot work (sync / periodic mode, a multi-turn generator, routing replay)."""

from __future__ import annotations

import pytest

from tests.test_config import error, load

STALE = ["pipeline.mode=stale", "pipeline.max_staleness=1", "algorithm.loss=ppo_decoupled", "pipeline.queue_size=64"]


def test_off_by_default_and_accepted_in_stale_mode(tmp_path):
    assert load(tmp_path).rollout.in_flight_updates is False
    cfg = load(tmp_path, overrides=[*STALE, "rollout.in_flight_updates=true"])
    assert cfg.rollout.in_flight_updates is True


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["pipeline.mode=periodic"], ["needs pipeline.mode 'stale'", "'periodic'"]),
        (["pipeline.mode=sync"], ["needs pipeline.mode 'stale'", "'sync'"]),
        ([*STALE, "environment.kind=echo"], ["single_turn generator", "'echo'"]),
        ([*STALE, "rollout.generator=multi_turn", "environment.kind=echo"], ["single_turn generator"]),
    ],
)
def test_refused_where_it_cannot_work(tmp_path, overrides, words):
    err = error(tmp_path, overrides=[*overrides, "rollout.in_flight_updates=true"])
    assert "rollout.in_flight_updates" in err.keys
    assert "rollout.in_flight_updates: " in str(err)
    for word in words:
        assert word in str(err)


def test_engine_settings_carry_the_bound_to_the_workers(tmp_path):
    from megatron_rl.rollout.build import worker_specs
    from megatron_rl.trainer.from_config import engine_settings

    cfg = load(tmp_path, overrides=[*STALE, "rollout.in_flight_updates=true"])
    settings = engine_settings(cfg, model_path=str(tmp_path))
    assert [s.in_flight_staleness for s in worker_specs(settings)] == [1]
    off = engine_settings(load(tmp_path, overrides=STALE), model_path=str(tmp_path))
    assert [s.in_flight_staleness for s in worker_specs(off)] == [None]
