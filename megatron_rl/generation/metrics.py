"""Per-step figures of multi-turn generation, over the step's scored groups (logged as ``multiturn/...``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TurnFigures(Protocol):
    """What the figures read of a scored sample (``pipeline.Sample`` fits)."""

    loss_mask: tuple[int, ...] | None  # None: a single-turn sample (not counted)
    response_ids: tuple[int, ...]
    turns: int
    tool_calls: int
    tool_errors: int
    env_failures: int
    env_s: float
    truncated: bool
    turn_prompt_tokens: int
    cached_tokens: int | None


class GroupFigures(Protocol):
    """A scored group (``pipeline.ScoredGroup`` fits); no samples: its environment reset failed."""

    @property
    def samples(self) -> Sequence[TurnFigures]: ...


def multiturn_metrics(groups: Sequence[GroupFigures]) -> dict[str, float]:
    """Per-step ``multiturn/...`` figures over a step's ``groups`` ({} when none is multi-turn);
    ``reset_failures``: groups dropped because their environment reset failed (no samples)."""
    failed = sum(not g.samples for g in groups)
    multi = [s for g in groups for s in g.samples if s.loss_mask is not None]
    if not multi:
        return {"multiturn/reset_failures": float(failed)} if failed else {}
    model = sum(sum(s.loss_mask) for s in multi)
    total = sum(len(s.response_ids) for s in multi)
    cached = [s for s in multi if s.cached_tokens is not None]
    return {
        "multiturn/turns_mean": sum(s.turns for s in multi) / len(multi),
        "multiturn/turns_max": float(max(s.turns for s in multi)),
        "multiturn/tool_calls": float(sum(s.tool_calls for s in multi)),
        "multiturn/tool_errors": float(sum(s.tool_errors for s in multi)),
        "multiturn/env_failures": float(sum(s.env_failures for s in multi)),
        "multiturn/truncated_fraction": sum(s.truncated for s in multi) / len(multi),
        "multiturn/model_tokens": float(model),
        "multiturn/observation_tokens": float(total - model),
        "multiturn/env_s": sum(s.env_s for s in multi),
        "multiturn/reset_failures": float(failed),
        # turns' prompt tokens the engine's prefix cache served (engines that report it: vLLM)
        **(
            {
                "multiturn/prefix_cache_hit_rate": sum(s.cached_tokens for s in cached)
                / max(1, sum(s.turn_prompt_tokens for s in cached))
            }
            if cached
            else {}
        ),
    }
