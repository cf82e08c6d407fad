"""``multiturn/prefix_cache_hit_rate``: over a step's multi-turn samples whose engine reported
prefix-cache hits, the turns' cached prompt tokens over all their turns' prompt tokens (samples
of an engine that reports none, e.g. hf, are left out; no such sample, no figure)."""

from __future__ import annotations

import torch

from megatron_rl.generation import multiturn_metrics
from megatron_rl.pipeline.records import Sample, ScoredGroup


def sample(k: int, prompt_tokens: int, cached: int | None) -> Sample:
    return Sample(
        prompt_id="p",
        request_id=f"0/p/{k}",
        index=k,
        prompt_ids=(1, 2),
        response_ids=(3, 4, 5),
        behav_logprobs=(-1.0, 0.0, -1.0),
        weight_version=0,
        finish_reason="stop",
        reward=0.0,
        loss_mask=(1, 0, 1),
        turns=2,
        turn_prompt_tokens=prompt_tokens,
        cached_tokens=cached,
    )


def group(*samples: Sample) -> ScoredGroup:
    zeros = torch.zeros(len(samples))
    return ScoredGroup(
        step=0, prompt_index=0, prompt_id="p", samples=samples, rewards=zeros, advantages=zeros, kept=True
    )


def test_prefix_cache_hit_rate_over_reporting_samples():
    metrics = multiturn_metrics([group(sample(0, 100, 32), sample(1, 60, 0)), group(sample(2, 500, None))])
    assert metrics["multiturn/prefix_cache_hit_rate"] == (32 + 0) / (100 + 60)
    assert "multiturn/prefix_cache_hit_rate" not in multiturn_metrics([group(sample(0, 100, None))])
