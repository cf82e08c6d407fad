"""The static baseline: the same group size every step, with the same straggler bookkeeping as
SAGC so that fixed-G runs log comparable straggler rates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from megatron_rl.control.base import (
    DEFAULT_TAU,
    StepObservation,
    check_group_size,
    check_tau,
    measure_step,
)


class FixedController:
    """Always chooses `group_size`; counts straggler events (max/median > tau) for the metrics."""

    def __init__(self, group_size: int, *, tau: float = DEFAULT_TAU) -> None:
        self.group_size = check_group_size(group_size)
        self.tau = check_tau(tau)
        self._steps = 0
        self._stragglers = 0
        self._last: StepObservation | None = None

    def choose(self) -> int:
        """The fixed group size."""
        return self.group_size

    def observe(self, response_lengths: Sequence[int]) -> StepObservation:
        """Measure the step's straggler ratio (response_lengths: (N,) token counts)."""
        obs = measure_step(response_lengths, group_size=self.group_size, tau=self.tau)
        self._steps += 1
        self._stragglers += int(obs.straggler)
        self._last = obs
        return obs

    def state_dict(self) -> dict[str, Any]:
        """Step and straggler counters (the decision itself has no state)."""
        return {"group_size": self.group_size, "steps": self._steps, "stragglers": self._stragglers}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters; the checkpoint's group size must equal this controller's."""
        if state["group_size"] != self.group_size:
            raise ValueError(
                f"checkpoint group_size ({state['group_size']}) differs from the configured "
                f"group_size ({self.group_size})"
            )
        self._steps = int(state["steps"])
        self._stragglers = int(state["stragglers"])
        self._last = None

    def metrics(self) -> dict[str, float]:
        """control/group_size, running straggler rate, and the last step's straggler ratio."""
        out = {
            "control/group_size": float(self.group_size),
            "control/straggler_rate": self._stragglers / max(self._steps, 1),
        }
        if self._last is not None:
            out["control/straggler"] = float(self._last.straggler)
            out["control/straggler_ratio"] = self._last.straggler_ratio
        return out
