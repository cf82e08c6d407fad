"""A recorded run whose samples span two weight versions replays to its weights (issue 31).

The live run trains in stale mode (max_staleness 1, the whole next batch sampled one version
behind, ``LeadHoldingEngine``) on the emulated 910B; its engine reports the second half of every
answer sampled ahead of its batch at the next version, as an in-flight update would
(``token_versions`` (v, .., v, v+1, .., v+1)). The trainer then treats those tokens as sampled by
its own weights: the mismatch metrics measure them (in steady state, where every first token is
one version old and nothing would be measured otherwise) and the staleness statistics count the
samples as mixed. The recording of that run, replayed with no engine, reproduces the live run's
weights and its per-token metrics."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.distributed import run_distributed
from tests.rl_fixtures import TRAIN_PLATFORM, LeadHoldingEngine, load_weights, make_tiny_rl_model, tiny_rl_config

STEPS, PROMPTS, G = 3, 3, 4
STALE = [
    "pipeline.mode=stale",
    "pipeline.max_staleness=1",
    "pipeline.queue_size=16",
    "algorithm.loss=ppo_decoupled",
    "algorithm.proximal=loglinear",
    "algorithm.rollout_correction.probe_sequences=0",  # the probe is off in a replay: alike on both sides
]


class SplitVersionEngine(LeadHoldingEngine):
    """An answer to a batch ahead of the engine's weights reports its second half at the next version."""

    def generate(self, requests):
        for result in super().generate(requests):
            step, n, v = int(result.request_id.split("/")[0]), len(result.response_ids), result.weight_version
            if v < step and n >= 2:
                result = replace(result, token_versions=(v,) * (n // 2) + (v + 1,) * (n - n // 2))
            yield result


def train_split(config_path: str, overrides: list[str]) -> list[dict]:
    """A rank's body: the live run with ``SplitVersionEngine``s; the metric history."""
    from megatron_rl.config import load_config
    from megatron_rl.rollout import build_engine
    from megatron_rl.trainer.loop import train

    cfg = load_config(config_path, overrides)

    def factory(settings):
        return SplitVersionEngine(build_engine(settings), lead=1, batches=STEPS, results=PROMPTS * G)

    return train(cfg, platform=TRAIN_PLATFORM, engine_factory=factory)


def replay_run(config_path: str, overrides: list[str], recording: str) -> list[dict]:
    """A rank's body: train on ``recording`` with no engine; the metric history."""
    from megatron_rl.config import load_config
    from megatron_rl.trainer.loop import train

    return train(load_config(config_path, overrides), platform=TRAIN_PLATFORM, replay=recording)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_recorded_run_spanning_versions_replays_its_weights(tmp_path):
    model = make_tiny_rl_model(tmp_path / "model")
    config = tiny_rl_config(
        tmp_path,
        model,
        reward={"fn": "tests.rl_fixtures:digit_share_reward"},
        trainer={"steps": STEPS, "prompts_per_batch": PROMPTS, "lr": 1e-2, "adam_eps": 1e-3},
    )
    rec = tmp_path / "live.jsonl"
    saves = ["trainer.save_every=1"]
    (live,) = run_distributed(
        train_split,
        1,
        str(config),
        [*STALE, *saves, f"rollout.record={rec}", f"trainer.save_dir={tmp_path / 'live'}"],
        timeout_s=600,
    )
    assert '"token_versions": [' in rec.read_text()
    steady = live[1:]  # every sample's first token one version old, its second half at the policy's
    for h in steady:
        assert h["rollout/staleness_mean"] == 1 and h["rollout/mixed_version_samples"] > 0
        assert h["rollout/staleness_token_mean"] < 1
        assert h["mismatch/n_tokens"] > 0  # measured: only the tokens reported at the policy's version
    (replayed,) = run_distributed(
        replay_run,
        1,
        str(config),
        [*STALE, *saves, f"trainer.save_dir={tmp_path / 'replayed'}"],
        str(rec),
        timeout_s=600,
    )
    for key in ("rollout/staleness_token_mean", "rollout/mixed_version_samples", "mismatch/n_tokens"):
        assert [h[key] for h in replayed] == [h[key] for h in live], key
    a = load_weights(tmp_path / "live" / f"step_{STEPS}" / "model")
    b = load_weights(tmp_path / "replayed" / f"step_{STEPS}" / "model")
    initial = load_weights(model)
    assert max((a[k] - initial[k]).abs().max().item() for k in a) > 1e-3
    for key, value in a.items():
        assert ((b[key] - value).abs().max() / value.abs().max()).item() <= 1e-6, key
