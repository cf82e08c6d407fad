"""The group-size controller contract and the straggler measurement every controller shares.

A controller is a small CPU-side object the training loop talks to once per step:

    g = controller.choose()                     # group size G_t for this step's rollout
    ... generate G_t responses per prompt, train ...
    controller.observe(response_lengths)        # lengths of *all* responses of the step
    logger.log(controller.metrics())            # flat {name: float}
    checkpoint["controller"] = controller.state_dict()

`choose` is idempotent until `observe`: a second call before `observe` returns the same G
(so a loop that restarts a step does not redraw). `state_dict` returns plain Python values
(ints, floats, lists, dicts) that survive `torch.save` and JSON exactly, and
`load_state_dict(state_dict())` restores a controller that makes the same future decisions.

A straggler event of a step (SAGC paper, S_t) is max(lengths) / median(lengths) > tau, over
the response lengths of the whole step (gathered across data-parallel ranks by the caller).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from megatron_rl.config.fields import require_values
from megatron_rl.config.schema import SAGCConfig

DEFAULT_TAU = SAGCConfig.tau  # the straggler threshold when no SAGC settings are given


@dataclass(frozen=True, kw_only=True)
class StepObservation:
    """What a controller saw at the end of one step."""

    group_size: int  # G_t the step was generated with
    num_responses: int  # how many response lengths were observed
    max_length: int  # longest response, tokens
    median_length: float  # median response length, tokens (mean of the two middle ones if even)
    straggler_ratio: float  # max_length / median_length
    straggler: bool  # S_t: straggler_ratio > tau


@runtime_checkable
class GroupSizeController(Protocol):
    """Picks the rollout group size of each step from the response lengths of past steps."""

    def choose(self) -> int:
        """Group size G for the coming step; repeated calls before `observe` return the same G."""
        ...

    def observe(self, response_lengths: Sequence[int]) -> StepObservation:
        """Record the finished step's response lengths (tokens, all prompts of the step)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as plain Python values."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by `state_dict`."""
        ...

    def metrics(self) -> dict[str, float]:
        """Flat {name: value} of the latest decision and estimates, for the metric logger."""
        ...


def measure_step(response_lengths: Sequence[int], *, group_size: int, tau: float) -> StepObservation:
    """Straggler statistics of one step.

    response_lengths: (N,) positive token counts of every response of the step, N >= 1.
    Returns the StepObservation with S_t = [max / median > tau].
    """
    lengths = np.asarray(response_lengths)
    if lengths.ndim != 1 or lengths.size == 0:
        raise ValueError(f"response_lengths must be a non-empty 1-D sequence, got shape {lengths.shape}")
    if not np.issubdtype(lengths.dtype, np.integer) or int(lengths.min()) < 1:
        raise ValueError(
            f"response_lengths must be integers >= 1 (a response has at least one token), "
            f"got dtype {lengths.dtype} and min {lengths.min()}"
        )
    longest = int(lengths.max())
    median = float(np.median(lengths))
    ratio = longest / median
    return StepObservation(
        group_size=group_size,
        num_responses=int(lengths.size),
        max_length=longest,
        median_length=median,
        straggler_ratio=ratio,
        straggler=ratio > tau,
    )


def check_group_size(value: object) -> int:
    """Return `value` as an int if it is a valid ``control.group_size`` (the config's rule: a
    positive int, not a bool), else raise ValueError naming the key."""
    value = int(value) if isinstance(value, np.integer) else value
    require_values({"control.group_size": value})
    return value


def check_tau(value: float) -> float:
    """Return tau if it is a valid ``control.sagc.tau`` (the config's rule: > 1, as max/median is
    always >= 1), else raise ValueError naming the key."""
    require_values({"control.sagc.tau": value})
    return float(value)
