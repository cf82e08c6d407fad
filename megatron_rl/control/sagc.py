"""SAGC: straggler-aware group control (Thompson sampling + projected dual ascent).

Problem (paper summary, sec. 2): maximise the utility u(G) = log2(G) subject to a long-run
straggler rate E[S_t | G_t] <= delta, where S_t = [max / median response length of step t > tau].

Each step:
  choose   p~_G ~ Beta(alpha_G, beta_G) for every candidate (Thompson sampling), then
           G_t = argmax log2(G) - lambda * p~_G over the current candidate and its immediate
           neighbours in the sorted candidate list (the paper's local-search restriction).
  observe  s = S_t of the step;
           lambda <- clip(lambda + eta * (s - delta), 0, lambda_max)      (projected dual ascent)
           posterior with forgetting factor gamma, see below.

Posterior with forgetting. The paper summary says only that the Beta parameters are updated
"with a forgetting factor" for non-stationary lengths; it gives neither the formula nor what
happens to candidates that were not chosen. We keep the prior fixed and discount the evidence,
as discounted Thompson sampling does (Raj & Kalyani 2017, "Taming non-stationary bandits"):
alpha_G = prior_alpha + a_G, beta_G = prior_beta + b_G with, for the chosen candidate,
    a <- gamma * a + s,      b <- gamma * b + (1 - s),
i.e. the textbook alpha <- gamma*alpha + s applied to the evidence rather than to prior+evidence
(so the posterior can never collapse to Beta(., 0) after long runs of one outcome). With
`forget_unchosen=True` (default) the other candidates' evidence also decays, a <- gamma * a,
b <- gamma * b, so an estimate that has not been refreshed drifts back to the prior and gets
re-explored; `forget_unchosen=False` leaves them untouched. lambda starts at 0.

The random stream is a numpy Generator (default: seeded with settings.seed); its state is part
of `state_dict`, so a resumed run draws the same p~ and makes the same decisions.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_rl.config.fields import raise_found
from megatron_rl.config.schema import ControlConfig, SAGCConfig
from megatron_rl.config.sections import group_size_rule, require_valid
from megatron_rl.control.base import (
    StepObservation,
    measure_step,
)


@dataclass(frozen=True, kw_only=True)
class SAGCSettings(SAGCConfig):
    """SAGC hyper-parameters: the ``control.sagc`` section (every knob and its default declared once,
    in the config schema; tuned on tools/simulate_sagc.py) plus the first step's G."""

    initial: int = ControlConfig.group_size  # control.group_size: the first step's G, one of `candidates`

    def __post_init__(self) -> None:
        require_valid(self, "control.sagc")  # the config's own control.sagc rules
        raise_found(group_size_rule("sagc", self.initial, self.candidates))  # and control's: G_0 is a candidate
        object.__setattr__(self, "candidates", tuple(self.candidates))


class SAGCController:
    """Straggler-aware group-size controller (see the module docstring for the updates)."""

    def __init__(self, settings: SAGCSettings, *, rng: np.random.Generator | None = None) -> None:
        self.settings = settings  # checked when built (SAGCSettings.__post_init__)
        self._rng = rng if rng is not None else np.random.default_rng(settings.seed)
        self._log2g = np.log2(np.asarray(settings.candidates, dtype=np.float64))
        n = len(settings.candidates)
        self._straggler_evidence = np.zeros(n)  # a_G: discounted count of straggler steps
        self._clean_evidence = np.zeros(n)  # b_G: discounted count of clean steps
        self._lambda = 0.0
        self._index = settings.candidates.index(settings.initial)
        self._pending: int | None = None  # index chosen for the step in flight
        self._sample: np.ndarray | None = None  # p~ drawn at the last choose()
        self._steps = 0
        self._stragglers = 0
        self._last: StepObservation | None = None

    # -- posterior -----------------------------------------------------------------------------
    def posterior(self) -> tuple[np.ndarray, np.ndarray]:
        """(alpha, beta): Beta posterior parameters per candidate, each shape (num_candidates,)."""
        return (self.settings.prior_alpha + self._straggler_evidence, self.settings.prior_beta + self._clean_evidence)

    @property
    def lagrange_multiplier(self) -> float:
        """Current lambda."""
        return self._lambda

    # -- protocol ------------------------------------------------------------------------------
    def choose(self) -> int:
        """Thompson-sample p~ for all candidates, return argmax log2 G - lambda p~ among the
        current candidate and its neighbours; idempotent until `observe`. The first step (no
        observation yet) runs `settings.initial`, so `control.group_size` is the first G."""
        if self._pending is None and self._steps == 0:
            self._pending = self._index  # nothing observed yet: the first step runs the configured G
        if self._pending is None:
            alpha, beta = self.posterior()
            self._sample = self._rng.beta(alpha, beta)
            lo, hi = max(self._index - 1, 0), min(self._index + 2, len(alpha))
            scores = self._log2g[lo:hi] - self._lambda * self._sample[lo:hi]
            self._pending = lo + int(np.argmax(scores))
        return self.settings.candidates[self._pending]

    def observe(self, response_lengths: Sequence[int]) -> StepObservation:
        """Update the posterior of the chosen G and lambda from the step's response lengths (N,)."""
        if self._pending is None:
            raise RuntimeError("SAGCController.observe() called without a preceding choose()")
        s = self.settings
        chosen = self._pending
        obs = measure_step(response_lengths, group_size=s.candidates[chosen], tau=s.tau)
        hit = float(obs.straggler)
        if s.forget_unchosen:
            self._straggler_evidence *= s.gamma
            self._clean_evidence *= s.gamma
        else:
            self._straggler_evidence[chosen] *= s.gamma
            self._clean_evidence[chosen] *= s.gamma
        self._straggler_evidence[chosen] += hit
        self._clean_evidence[chosen] += 1.0 - hit
        self._lambda = min(max(self._lambda + s.eta * (hit - s.delta), 0.0), s.lambda_max)
        self._index, self._pending = chosen, None
        self._steps += 1
        self._stragglers += int(obs.straggler)
        self._last = obs
        return obs

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state: evidence, lambda, position, counters, RNG state."""
        return {
            "candidates": list(self.settings.candidates),
            "straggler_evidence": self._straggler_evidence.tolist(),
            "clean_evidence": self._clean_evidence.tolist(),
            "lambda": self._lambda,
            "index": self._index,
            "pending": self._pending,
            "sample": None if self._sample is None else self._sample.tolist(),
            "steps": self._steps,
            "stragglers": self._stragglers,
            "rng": copy.deepcopy(self._rng.bit_generator.state),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()` output; the candidate set must match the settings."""
        if list(state["candidates"]) != list(self.settings.candidates):
            raise ValueError(
                f"checkpoint candidates {list(state['candidates'])} differ from the configured "
                f"candidates {list(self.settings.candidates)}"
            )
        rng_state = state["rng"]
        expected = self._rng.bit_generator.state["bit_generator"]
        if rng_state["bit_generator"] != expected:
            raise ValueError(f"checkpoint rng is {rng_state['bit_generator']}, this controller uses {expected}")
        self._straggler_evidence = np.asarray(state["straggler_evidence"], dtype=np.float64)
        self._clean_evidence = np.asarray(state["clean_evidence"], dtype=np.float64)
        self._lambda = float(state["lambda"])
        self._index = int(state["index"])
        self._pending = None if state["pending"] is None else int(state["pending"])
        self._sample = None if state["sample"] is None else np.asarray(state["sample"], np.float64)
        self._steps = int(state["steps"])
        self._stragglers = int(state["stragglers"])
        self._rng.bit_generator.state = copy.deepcopy(dict(rng_state))
        self._last = None

    def metrics(self) -> dict[str, float]:
        """Decision, lambda, straggler stats and, per candidate G, posterior alpha/beta/mean and
        the last Thompson sample, as `control/<name>` or `control/<name>/G<g>`."""
        now = self._pending if self._pending is not None else self._index
        g_now = self.settings.candidates[now]
        out = {
            "control/group_size": float(g_now),
            "control/lambda": self._lambda,
            "control/straggler_rate": self._stragglers / max(self._steps, 1),
        }
        if self._last is not None:
            out["control/straggler"] = float(self._last.straggler)
            out["control/straggler_ratio"] = self._last.straggler_ratio
        alpha, beta = self.posterior()
        for i, g in enumerate(self.settings.candidates):
            out[f"control/alpha/G{g}"] = float(alpha[i])
            out[f"control/beta/G{g}"] = float(beta[i])
            out[f"control/p_mean/G{g}"] = float(alpha[i] / (alpha[i] + beta[i]))
            if self._sample is not None:
                out[f"control/p_sample/G{g}"] = float(self._sample[i])
        return out
