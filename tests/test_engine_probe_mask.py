"""The engine probe compares the engine with the policy on model tokens only: observation tokens
of multi-turn trajectories (the environment's, not the engine's samples) are left out, as the
loss leaves them out. Reference: the metrics written out over the model tokens by hand."""

from __future__ import annotations

import torch

from megatron_rl.pipeline.records import make_micro_batch
from megatron_rl.trainer.engine_probe import compare_probe
from tests.test_policy_trainer import make_groups


def test_probe_ignores_observation_tokens():
    mb = make_micro_batch(make_groups(vocab=50, masked=True), policy_version=1)
    model = mb.loss_mask.bool()
    policy = -torch.rand(mb.behav_logprobs.shape, generator=torch.Generator().manual_seed(1))
    engine = policy.clone()
    engine[model] -= 0.01  # a small, uniform gap on the engine's own tokens
    engine[~model] -= 5.0  # observation tokens: far off, and must not count
    metrics = compare_probe(policy, engine, mb)
    assert int(metrics.n_tokens) == int(model.sum()) < model.numel()
    assert abs(float(metrics.abs_diff_max) - 0.01) < 1e-5
    assert abs(float(metrics.abs_diff_sum) / int(model.sum()) - 0.01) < 1e-5
