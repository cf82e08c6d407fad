"""A stale-mode RL run with ``rollout.in_flight_updates`` on (emulated device, hf engine): it
trains, the trainer's syncs reach requests while they decode, and every recorded response token's
behaviour log-prob equals a transformers teacher-forced forward of the checkpoint of the version
that token records (the checkpoints the run saved after each step)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import run_distributed
from tests.rl_fixtures import make_tiny_rl_model, teacher_forced_logprobs, tiny_rl_config, train_recorded

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_stale_run_with_in_flight_updates_samples_each_token_from_its_version(tmp_path):
    model = make_tiny_rl_model(tmp_path / "model")
    config = tiny_rl_config(
        tmp_path,
        model,
        reward={"fn": "tests.rl_fixtures:digit_share_reward"},
        data={"max_prompt_tokens": 128},
        rollout={"in_flight_updates": True, "sampling": {"temperature": 1.0, "max_new_tokens": 40, "seed": 3}},
        pipeline={"mode": "stale", "max_staleness": 1, "queue_size": 64, "micro_batch_tokens": 1024},
        algorithm={"loss": "ppo_decoupled", "proximal": "loglinear"},
        trainer={"steps": 2, "prompts_per_batch": 3, "lr": 1e-2, "adam_eps": 1e-3},
    )
    out = tmp_path / "run"
    ((history, results),) = run_distributed(
        train_recorded, 1, str(config), [f"trainer.save_dir={out}", "trainer.save_every=1"], timeout_s=900
    )
    assert [h["train/version"] for h in history] == [1.0, 2.0]
    assert all(math.isfinite(h["loss/value"]) for h in history)
    assert all("partial/requests_updated" in h for h in history)
    by_version: dict[int, list] = {}
    for r in results:
        versions = r.token_versions or (r.weight_version,) * len(r.response_ids)
        for v in set(versions):
            by_version.setdefault(v, []).append((r, [i for i, tv in enumerate(versions) if tv == v]))
    gap = 0.0
    for v, items in by_version.items():
        checkpoint = model if v == 0 else out / f"step_{v}" / "model"
        refs = teacher_forced_logprobs(checkpoint, [(r.prompt_ids, r.response_ids) for r, _ in items])
        for (r, positions), ref in zip(items, refs, strict=True):
            got, want = torch.tensor(r.logprobs)[positions], torch.tensor(ref)[positions]
            gap = max(gap, (got - want.float()).abs().max().item())
    spanning = sum(r.token_versions is not None for r in results)
    print(f"in-flight RL run: {spanning} of {len(results)} trajectories span two versions; gap {gap:.2e}")
    assert spanning >= 1, "no sync reached a running request"
    assert gap < 1e-4
