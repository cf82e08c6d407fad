"""``parallel.timeout_s``: an engine that sleeps past a lowered limit ends a 2-rank run on every
rank with an error naming the knob and what each rank was waiting for, well before the old
fixed waits (600 s default group, 30 min megatron groups) would have."""

from __future__ import annotations

import time

import pytest

from megatron_rl.parallel.world_timeout import GRACE_S
from tests.distributed import run_distributed
from tests.rl_fixtures import TRAIN_PLATFORM, make_tiny_rl_model, tiny_rl_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

TIMEOUT_S = 3.0


def _train_with_a_silent_engine(config: str, overrides: list[str]) -> tuple[str, float]:
    """A rank's body: train with an engine that never answers (until shut down); the error's
    message and how long the first step waited."""
    from megatron_rl.config import load_config
    from megatron_rl.parallel.world_timeout import WorldTimeout
    from megatron_rl.trainer.loop import train
    from tests.pipeline_fakes import FakeEngine

    start = time.monotonic()
    try:
        train(
            load_config(config, overrides),
            platform=TRAIN_PLATFORM,
            engine_factory=lambda settings: FakeEngine(block_after=0),
        )
    except WorldTimeout as err:
        return str(err), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_a_generation_past_the_timeout_names_the_knob_on_every_rank(tmp_path):
    model = make_tiny_rl_model(tmp_path / "model")
    config = tiny_rl_config(tmp_path, model, trainer={"steps": 2, "prompts_per_batch": 2})
    (leader, t0), (follower, t1) = run_distributed(
        _train_with_a_silent_engine, 2, str(config), [f"parallel.timeout_s={TIMEOUT_S}"], timeout_s=300
    )
    assert "parallel.timeout_s=3 expired" in leader and "for the pipeline's next group" in leader, leader
    assert "rank 1: rank 0 ended the run: parallel.timeout_s=3 expired" in follower, follower
    assert max(t0, t1) < 400 < 600  # set-up (slow on a loaded CI machine) plus the lowered limit, not 600 s / 30 min
    assert GRACE_S > TIMEOUT_S  # the followers' groups outwait rank 0: its named reason reaches them
