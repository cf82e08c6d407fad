"""Generation: prompts -> trajectories on an engine, by a generator chosen by name (single / multi-turn).

Modules: `base` (the contract: ``BatchRequest`` in, ``Trajectory`` / ``FailedGroup`` out, the
``Generator`` protocol, how DAPO overlong shaping measures a group, and the registry
``register_generator`` / ``build_generator``), `single_turn` (one ``generate`` call per batch,
one response per (prompt, k)), `multi_turn` (environment turns on one ``generate_stream``:
resets, shared prompts) with `turn_loop` (the turns, budgets, observations spliced in),
`metrics` (the ``multiturn/...`` figures of a step), `agent` (users' OpenAI-API agents, one per
trajectory, against the ``gateway``). The pipeline's producer drives a generator
and scores what it yields; ``trainer.from_config`` picks one by ``environment.kind``.
"""

from megatron_rl.generation.agent import AgentGenerator, AgentSettings, AgentStats
from megatron_rl.generation.base import (
    BatchRequest,
    FailedGroup,
    Generator,
    GeneratorSetup,
    OverlongLengths,
    PromptItem,
    Trajectory,
    build_generator,
    generator_metrics,
    register_generator,
    request_id,
    request_seed,
    response_lengths,
)
from megatron_rl.generation.metrics import multiturn_metrics
from megatron_rl.generation.multi_turn import GroupStart, MultiTurnGenerator
from megatron_rl.generation.single_turn import Detokenize, SingleTurnGenerator
from megatron_rl.generation.turn_loop import MultiTurnSettings, StepRunner

__all__ = [
    "AgentGenerator",
    "AgentSettings",
    "AgentStats",
    "BatchRequest",
    "Detokenize",
    "FailedGroup",
    "Generator",
    "GeneratorSetup",
    "GroupStart",
    "MultiTurnGenerator",
    "MultiTurnSettings",
    "OverlongLengths",
    "PromptItem",
    "StepRunner",
    "SingleTurnGenerator",
    "Trajectory",
    "build_generator",
    "generator_metrics",
    "multiturn_metrics",
    "register_generator",
    "request_id",
    "request_seed",
    "response_lengths",
]
