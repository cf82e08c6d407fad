"""Group-size controllers (fixed, SAGC): pick the rollout group size from length statistics.

Contract: `GroupSizeController` in `base.py`; build one with `load_controller("fixed" | "sagc" |
"package.module:ClassName", ...)`. The simulated length/cost model used to evaluate SAGC lives in
`simulation.py` (driven by `tools/simulate_sagc.py`).
"""

from megatron_rl.control.base import GroupSizeController, StepObservation, measure_step
from megatron_rl.control.fixed import FixedController
from megatron_rl.control.loader import load_controller
from megatron_rl.control.sagc import SAGCController, SAGCSettings

__all__ = [
    "FixedController",
    "GroupSizeController",
    "SAGCController",
    "SAGCSettings",
    "StepObservation",
    "load_controller",
    "measure_step",
]
