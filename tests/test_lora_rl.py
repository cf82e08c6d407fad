"""A short RL run with LoRA (``lora.rank: 8``) through the real loop on the emulated 910B device,
at TP 1 and TP 2: every step takes its optimizer steps with a finite loss and gradient norm, the
old policy and the reference run as shared streams (no copies: their memory metrics are the
adapter snapshot and 0), and the adapters move the policy off the base (KL to the reference > 0)."""

from __future__ import annotations

import math

import pytest

from tests.distributed import run_distributed
from tests.rl_fixtures import make_tiny_rl_model, tiny_rl_config, train_run

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

LORA = ["lora.rank=8", "lora.alpha=16", "algorithm.kl.coef=0.1", "trainer.mini_batches=2"]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_rl")
    model = make_tiny_rl_model(tmp / "model")
    return str(
        tiny_rl_config(
            tmp,
            model,
            reward={"fn": "tests.rl_fixtures:digit_share_reward"},
            trainer={"steps": 2, "prompts_per_batch": 4, "lr": 1e-2},
        )
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_rl_run_trains_with_finite_loss(config, tp):
    ranks = run_distributed(train_run, tp, config, [*LORA, f"parallel.tp={tp}"], timeout_s=900)
    history = ranks[0]
    assert [h["train/version"] for h in history] == [1.0, 2.0]
    for step in history:
        assert step["train/optimizer_steps"] == 2.0
        assert math.isfinite(step["loss/value"]) and math.isfinite(step["loss/grad_norm"])
        assert step["trimodel/ref_device_bytes"] == 0.0, "a reference copy was built"
        assert 0 < step["trimodel/old_device_bytes"] < step["trimodel/policy_device_bytes"]  # the snapshot
    assert history[-1]["loss/kl_ref"] > 0, "the adapters did not move the policy off the base"
