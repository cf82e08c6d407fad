"""DAPO over-sampling in a real run (``algorithm.oversample``): the tiny model trains on the emulated
device with the hf engine, periodic (DAPO loss) and stale (decoupled PPO, max_staleness 1), drawing
twice the prompts the batch trains. Each step trains at most ``prompts_per_batch`` groups, the
surplus prompts are counted as aborted or surplus, and every token an engine result holds came from
the weights of its version (teacher-forced transformers forward of that step's checkpoint). The
carry-over run (partial rollout) continues aborted prompts in the next batch: its continued
requests are prompt + carried tokens, checked the same way."""

from __future__ import annotations

import math

import pytest

from tests.distributed import run_distributed
from tests.rl_fixtures import make_tiny_rl_model, teacher_forced_logprobs, tiny_rl_config, train_recorded

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

RUNS = {
    "periodic_dapo": ["algorithm.loss=dapo"],
    "stale_decoupled": ["algorithm.loss=ppo_decoupled", "pipeline.mode=stale", "pipeline.max_staleness=1"],
    # partial rollout: aborted prompts continue next batch (rollout.carry_over; in-flight updates on)
    "stale_carry_over": [
        "algorithm.loss=ppo_decoupled", "pipeline.mode=stale", "pipeline.max_staleness=2",
        "rollout.carry_over=true", "rollout.in_flight_updates=true",
    ],
}  # fmt: skip


@pytest.mark.parametrize("run", list(RUNS))
def test_dapo_oversampling_trains(tmp_path, run):
    model = make_tiny_rl_model(tmp_path / "model")
    config = tiny_rl_config(
        tmp_path,
        model,
        reward={"fn": "tests.rl_fixtures:digit_share_reward"},
        data={"max_prompt_tokens": 128},
        algorithm={"loss": "dapo", "dynamic_sampling": True, "oversample": 2.0},
        trainer={"steps": 2, "prompts_per_batch": 2, "lr": 1e-2, "adam_eps": 1e-3},
    )
    out = tmp_path / "out"
    overrides = [*RUNS[run], f"trainer.save_dir={out}", "trainer.save_every=1"]
    ((history, results),) = run_distributed(train_recorded, 1, str(config), overrides, timeout_s=900)
    assert len(history) == 2
    for m in history:
        assert m["control/oversample_prompts"] == 2.0 + m.get("partial/carried_prompts", 0)  # 4 drawn (+ carried) for 2
        assert m["train/responses"] <= 2 * 4  # at most prompts_per_batch groups of G = 4
        assert m["control/aborted_groups"] + m["control/surplus_groups"] <= m["control/oversample_prompts"]
        assert math.isfinite(m["loss/value"])
        assert ("partial/carried_prompts" in m) == ("rollout.carry_over=true" in RUNS[run])
    for r in results:  # every token, an aborted request's too: the log-prob of the version that sampled it
        versions = r.token_versions or (r.weight_version,) * len(r.response_ids)
        for v in sorted(set(versions)):
            ckpt = model if v == 0 else out / f"step_{v}" / "model"
            (ref,) = teacher_forced_logprobs(ckpt, [(r.prompt_ids, r.response_ids)])
            gaps = [abs(a - b) for a, b, w in zip(r.logprobs, ref, versions, strict=True) if w == v]
            assert max(gaps) <= 1e-4, r.request_id
