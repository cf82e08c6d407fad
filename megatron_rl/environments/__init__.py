"""Multi-turn environments: tools, sandboxes and tasks a trajectory talks to between model turns.

Contract: `Environment` / `StepResult` / `Message` in `base.py`; build a per-trajectory factory
with `load_environment(environment.kind, **environment.options)` (`loader.py`); `record_fields`
turns a `PromptRecord` into what `Environment.reset` receives. `EnvironmentRunner` (`runner.py`)
runs the calls off the producer thread with a time limit and failure counts. Token in / token
out through the chat template: `prompt_ids`, `observation_ids`, `end_of_turn_id`, and
`parse_tool_calls` for the <tool_call> format (`template.py`).
"""

from megatron_rl.environments.base import Environment, EnvironmentFactory, Message, StepResult, record_fields
from megatron_rl.environments.loader import BUILTIN_ENVIRONMENTS, load_environment
from megatron_rl.environments.runner import (
    EnvironmentCallFailed,
    EnvironmentFailureLimit,
    EnvironmentRunner,
    EnvironmentStats,
)
from megatron_rl.environments.template import (
    TemplateError,
    ToolCall,
    end_of_turn_id,
    observation_ids,
    parse_tool_calls,
    prompt_ids,
)

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "Environment",
    "EnvironmentCallFailed",
    "EnvironmentFactory",
    "EnvironmentFailureLimit",
    "EnvironmentRunner",
    "EnvironmentStats",
    "Message",
    "StepResult",
    "TemplateError",
    "ToolCall",
    "end_of_turn_id",
    "load_environment",
    "observation_ids",
    "parse_tool_calls",
    "prompt_ids",
    "record_fields",
]
