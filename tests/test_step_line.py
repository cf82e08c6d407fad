"""The console's step line shows what the update did (issue 30: GRPO's loss is ~0 by construction,
so ``loss -0.0000`` on every step told a user nothing): grad norm, clipped share of tokens, KL to
the reference (else to the old policy) and the engine mismatch, each only when measured."""

from __future__ import annotations

from megatron_rl.trainer.metrics import format_step

BASE = {
    "rollout/reward_mean": 0.25,
    "rollout/group_size": 8.0,
    "time/step_s": 12.34,
    "throughput/tokens_per_s_per_device": 101.0,
    "loss/value": -0.0,
}


def test_a_training_step_shows_grad_norm_clipping_kl_and_mismatch():
    line = format_step(
        3,
        {
            **BASE,
            "loss/grad_norm": 0.8123,
            "loss/clip_frac_low": 0.01,
            "loss/clip_frac_high": 0.02,
            "loss/approx_kl_old": 1e-4,
            "loss/kl_ref": 0.0031,
            "mismatch/kl_k3": 2.5e-5,
        },
    )
    assert line == (
        "step 3: reward 0.250 gnorm 0.812 clip 3.0% kl_ref 0.0031 mismatch 2.5e-05 G 8 12.3s 101.0 tok/s/dev"
    )
    assert "loss" not in line


def test_kl_to_the_old_policy_without_a_reference_and_nothing_when_not_trained():
    line = format_step(0, {**BASE, "loss/grad_norm": 1.5, "loss/clip_frac_low": 0.0, "loss/approx_kl_old": 0.002})
    assert " gnorm 1.5 clip 0.0% kl_old 0.002 G 8" in line and "mismatch" not in line
    assert format_step(1, BASE) == "step 1: reward 0.250 G 8 12.3s 101.0 tok/s/dev"  # rollout-only
