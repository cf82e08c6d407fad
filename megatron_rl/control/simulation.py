"""A simulated rollout workload for evaluating group-size controllers (tools/simulate_sagc.py).

Length model (per response, at training step t, group size G):
  body  lognormal, median `median_length`, log-sd `body_sigma` (max/median of a whole step's
        body draws stays near 2, well under a straggler threshold of 3);
  tail  with probability q(G, t) the response is a runaway: Pareto with minimum
        `tail_scale` x median and shape `tail_shape`, capped at `max_length` (max_new_tokens).
  q(G, t) = tail_prob * (G / reference_group) ** tail_group_exponent
                      * (1 + tail_growth * min(t / ramp_steps, 1)).
The per-step chance of a straggler grows with G twice: the step has prompts x G draws, and q
itself grows with G (the modelling choice that stands for the paper's finding that large groups
straggle disproportionately, e.g. 99.6% of steps at G=16 on Llama-3.2-3B/DAPO). It also grows
over training (longer chains of thought) and is stationary after `ramp_steps`.

Cost and wall-clock accounting. A step generates prompts x G_t responses in one batch; decoding
is latency-bound, so the batch finishes when its longest response does:
    step_seconds = step_overhead_s + seconds_per_token * max(lengths).
Policies are compared on the same amount of work: a policy's wall-clock is its measured seconds
per generated sample times a common budget of `work_samples` samples (by default what the
largest fixed G generates in `steps` steps), so a small G pays for needing more steps per
sample and a large G pays for its stragglers. Every policy sees the same step axis t (the
length drift follows optimizer steps, not samples) and the same length random stream seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_rl.control.base import GroupSizeController
from megatron_rl.control.fixed import FixedController
from megatron_rl.control.sagc import SAGCController, SAGCSettings


@dataclass(frozen=True, kw_only=True)
class LengthModel:
    """Heavy-tailed response-length distribution whose tail grows with G and with the step."""

    median_length: float = 1000.0  # median of the lognormal body, tokens
    body_sigma: float = 0.2  # log-sd of the body
    tail_prob: float = 3.2e-4  # per-response runaway probability at G = reference_group, t = 0
    tail_group_exponent: float = 1.7  # q grows as (G / reference_group) ** exponent
    tail_growth: float = 3.0  # q is (1 + tail_growth) times larger after the ramp
    ramp_steps: int = 1000  # steps over which q grows linearly, constant afterwards
    tail_scale: float = 8.0  # runaway lengths start at tail_scale x median_length
    tail_shape: float = 1.0  # Pareto shape of runaway lengths
    max_length: int = 32768  # generation cap (max_new_tokens)
    reference_group: int = 4  # G at which q = tail_prob (times the time factor)

    def __post_init__(self) -> None:
        for field in ("median_length", "body_sigma", "tail_scale", "tail_shape", "ramp_steps"):
            if getattr(self, field) <= 0:
                raise ValueError(f"LengthModel.{field} must be > 0, got {getattr(self, field)!r}")
        if not 0 <= self.tail_prob <= 1:
            raise ValueError(f"LengthModel.tail_prob must be in [0, 1], got {self.tail_prob!r}")
        if self.max_length < self.median_length:
            raise ValueError(
                f"LengthModel.max_length ({self.max_length}) must be >= median_length ({self.median_length})"
            )

    def tail_probability(self, *, group_size: int, step: int) -> float:
        """q(G, t): probability that one response of step t at group size G is a runaway."""
        ramp = min(step / self.ramp_steps, 1.0)
        growth = (group_size / self.reference_group) ** self.tail_group_exponent
        return min(self.tail_prob * growth * (1.0 + self.tail_growth * ramp), 1.0)

    def sample(self, rng: np.random.Generator, *, group_size: int, prompts: int, step: int) -> np.ndarray:
        """Response lengths of one step: int64 array of shape (prompts * group_size,), in
        [1, max_length]."""
        n = prompts * group_size
        body = self.median_length * np.exp(self.body_sigma * rng.standard_normal(n))
        runaway = rng.random(n) < self.tail_probability(group_size=group_size, step=step)
        # numpy's pareto is Lomax (support from 0); 1 + Lomax is the classical Pareto from 1.
        tail = self.tail_scale * self.median_length * (1.0 + rng.pareto(self.tail_shape, n))
        lengths = np.where(runaway, tail, body)
        return np.clip(np.rint(lengths), 1, self.max_length).astype(np.int64)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Seconds of one synchronous step: fixed overhead plus decoding of the longest response."""

    seconds_per_token: float = 0.02  # decode latency per token of the longest sequence
    step_overhead_s: float = 10.0  # scoring, training step, weight sync

    def step_seconds(self, lengths: np.ndarray) -> float:
        """Wall-clock of a step whose responses have `lengths` (N,) tokens."""
        return self.step_overhead_s + self.seconds_per_token * float(lengths.max())


@dataclass(frozen=True, kw_only=True)
class PolicyResult:
    """Outcome of one simulated run."""

    straggler_rate: float  # fraction of steps with max/median > tau
    wall_clock_h: float  # hours for `work_samples` samples at the run's seconds per sample
    mean_g: float  # mean group size over steps
    final_g: int  # group size of the last step
    late_straggler_rate: float  # straggler rate over the second half of the steps
    late_mean_g: float  # mean group size over the second half of the steps


def simulate(
    controller: GroupSizeController,
    *,
    steps: int,
    prompts: int,
    work_samples: int,
    lengths: LengthModel,
    cost: CostModel,
    rng: np.random.Generator,
) -> PolicyResult:
    """Run `controller` for `steps` steps of `prompts` prompts on the simulated workload."""
    if steps < 2:
        raise ValueError(f"steps must be >= 2, got {steps}")
    seconds, samples = 0.0, 0
    groups = np.empty(steps, dtype=np.int64)
    hits = np.empty(steps, dtype=bool)
    for t in range(steps):
        g = controller.choose()
        step_lengths = lengths.sample(rng, group_size=g, prompts=prompts, step=t)
        hits[t] = controller.observe(step_lengths).straggler
        groups[t] = g
        seconds += cost.step_seconds(step_lengths)
        samples += step_lengths.size
    return PolicyResult(
        straggler_rate=float(hits.mean()),
        wall_clock_h=seconds / samples * work_samples / 3600.0,
        mean_g=float(groups.mean()),
        final_g=int(groups[-1]),
        late_straggler_rate=float(hits[steps // 2 :].mean()),
        late_mean_g=float(groups[steps // 2 :].mean()),
    )


def compare_policies(
    *,
    settings: SAGCSettings,
    steps: int,
    prompts: int,
    seed: int,
    lengths: LengthModel,
    cost: CostModel,
) -> dict[str, PolicyResult]:
    """Simulate SAGC (key "sagc") and a fixed controller per candidate G (key "fixed_<G>") on
    the same workload and length seed; work budget = steps x prompts x largest candidate."""
    work = steps * prompts * settings.candidates[-1]
    controllers: dict[str, GroupSizeController] = {"sagc": SAGCController(settings)}
    for g in settings.candidates:
        controllers[f"fixed_{g}"] = FixedController(g, tau=settings.tau)
    return {
        name: simulate(
            controller,
            steps=steps,
            prompts=prompts,
            work_samples=work,
            lengths=lengths,
            cost=cost,
            rng=np.random.default_rng([seed, 1]),
        )
        for name, controller in controllers.items()
    }
