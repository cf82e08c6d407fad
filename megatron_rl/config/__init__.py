"""Typed configuration: dataclasses mirroring the YAML tree, loading, overrides, validation.

    cfg = load_config("examples/grpo_smollm2/config.yaml", ["trainer.lr=1e-5", "parallel.tp=3"])
    dp = validate_world(cfg, world_size)

Modules: `schema` (the dataclasses), `convert` (plain data <-> dataclasses), `loader` (YAML,
overrides, round trip), `fields` (one-field types and bounds), `sections` (the rules within a
section, also run by component settings), `validate` (rules across sections, world size),
`model_shape` (TP / PP vs the model), `devices` (rollout.devices strings), `resources` (what
the config points at: data file, model files, dotted paths), `errors`.
"""

from .errors import ConfigError, Problem
from .loader import config_from_dict, config_to_dict, load_config, save_config
from .schema import (
    AdvantageConfig,
    AgentConfig,
    AlgorithmConfig,
    AttentionConfig,
    ClipConfig,
    Config,
    ControlConfig,
    DataConfig,
    DistillConfig,
    KLConfig,
    LoraConfig,
    ModelConfig,
    OverlongConfig,
    ParallelConfig,
    PipelineConfig,
    RewardConfig,
    RolloutConfig,
    SAGCConfig,
    SamplingConfig,
    TrainerConfig,
)
from .validate import validate, validate_world

__all__ = [
    "AdvantageConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "AttentionConfig",
    "ClipConfig",
    "Config",
    "ConfigError",
    "ControlConfig",
    "DataConfig",
    "DistillConfig",
    "KLConfig",
    "LoraConfig",
    "ModelConfig",
    "OverlongConfig",
    "ParallelConfig",
    "PipelineConfig",
    "Problem",
    "RewardConfig",
    "RolloutConfig",
    "SAGCConfig",
    "SamplingConfig",
    "TrainerConfig",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "save_config",
    "validate",
    "validate_world",
]
