"""Learning signal of a GRPO step as a function of the group size G and the prompts' pass rates.

A group of G responses to one prompt carries a GRPO gradient only if its rewards are not all
equal (binary rewards: at least one right and one wrong answer); otherwise every advantage is
zero. With pass rate p, a group is informative with probability

    I(G; p) = 1 - p^G - (1 - p)^G.

Pass rates differ between prompts: p ~ Beta(alpha, beta) with mean m = alpha / (alpha + beta)
and concentration k = alpha + beta. Then, with E[p^n] = prod_{j<n} (alpha + j) / (k + j) (the
Beta moments) and E[(1 - p)^n] the same with alpha and beta swapped,

    I(G) = E[I(G; p)] = 1 - E[p^G] - E[(1 - p)^G].

Signal of a step of `prompts` prompts: prompts x I(G) x w(G), where the weight w says how much
one informative group is worth:
    "log2"     log2(G): the paper's own utility u(G) (SAGC summary, sec. 2: diminishing returns of
               larger groups): the default, so SAGC is judged by the objective it maximises;
    "groups"   1: informative groups (prompts that move the policy);
    "samples"  G: responses with a non-zero advantage (what DAPO's dynamic sampling counts).
The conclusion of a per-hour comparison can depend on w; tools/simulate_sagc.py prints all three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Weight = Literal["log2", "groups", "samples"]
WEIGHTS: tuple[Weight, ...] = ("log2", "groups", "samples")


def informative_probability(group_size: int, pass_rate: float) -> float:
    """I(G; p) = 1 - p^G - (1 - p)^G: chance that G binary rewards with success rate p differ."""
    if not 0.0 <= pass_rate <= 1.0:
        raise ValueError(f"pass_rate must be in [0, 1], got {pass_rate!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size!r}")
    return 1.0 - pass_rate**group_size - (1.0 - pass_rate) ** group_size


def beta_moment(alpha: float, beta: float, order: int) -> float:
    """E[p^order] for p ~ Beta(alpha, beta): prod_{j < order} (alpha + j) / (alpha + beta + j)."""
    if alpha <= 0 or beta <= 0:
        raise ValueError(f"Beta parameters must be > 0, got ({alpha!r}, {beta!r})")
    return math.prod((alpha + j) / (alpha + beta + j) for j in range(order))


def group_weight(group_size: int, weight: Weight) -> float:
    """w(G): worth of one informative group of size G (see the module docstring)."""
    if weight == "log2":
        return math.log2(group_size)
    if weight == "groups":
        return 1.0
    if weight == "samples":
        return float(group_size)
    raise ValueError(f"weight must be one of {WEIGHTS}, got {weight!r}")


@dataclass(frozen=True, kw_only=True)
class PassRateModel:
    """Per-prompt pass rate p ~ Beta with the given mean and concentration alpha + beta."""

    mean: float  # mean pass rate over prompts, in (0, 1)
    concentration: float  # alpha + beta; small = many prompts always right or always wrong

    def __post_init__(self) -> None:
        if not 0.0 < self.mean < 1.0:
            raise ValueError(f"PassRateModel.mean must be in (0, 1), got {self.mean!r}")
        if self.concentration <= 0:
            raise ValueError(f"PassRateModel.concentration must be > 0, got {self.concentration!r}")

    @property
    def alpha(self) -> float:
        """Beta alpha = mean x concentration."""
        return self.mean * self.concentration

    @property
    def beta(self) -> float:
        """Beta beta = (1 - mean) x concentration."""
        return (1.0 - self.mean) * self.concentration

    def informative_fraction(self, group_size: int) -> float:
        """I(G) = 1 - E[p^G] - E[(1 - p)^G]: expected fraction of informative groups."""
        return 1.0 - beta_moment(self.alpha, self.beta, group_size) - beta_moment(self.beta, self.alpha, group_size)

    def step_signal(self, group_size: int, prompts: int, weight: Weight) -> float:
        """Expected learning signal of one step: prompts x I(G) x w(G)."""
        return prompts * self.informative_fraction(group_size) * group_weight(group_size, weight)
