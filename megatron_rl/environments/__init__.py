"""Multi-turn environments: tools, sandboxes and tasks a trajectory talks to between model turns.

Contract: `Environment` / `StepResult` / `Message` in `base.py`; build a per-trajectory factory
with `load_environment(environment.kind, **environment.options)` (`loader.py`); `record_fields`
turns a `PromptRecord` into what `Environment.reset` receives.
"""

from megatron_rl.environments.base import Environment, EnvironmentFactory, Message, StepResult, record_fields
from megatron_rl.environments.loader import BUILTIN_ENVIRONMENTS, load_environment

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "Environment",
    "EnvironmentFactory",
    "Message",
    "StepResult",
    "load_environment",
    "record_fields",
]
