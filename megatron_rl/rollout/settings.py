"""Typed settings of a rollout engine pool.

``EngineSettings`` *is* the ``rollout`` config section (it extends ``RolloutConfig``: every
knob, its name and its default are declared once, in the schema) plus what the run resolves:
the checkpoint the engines start from, the model's dtype, extra worker environment. It is
checked at construction by the config's own ``rollout`` rules (``config.sections``), so an
engine built from Python is refused exactly as ``check-config`` refuses the YAML.
Device strings (``"cpu:0-1"``, ``"cuda:0,1"``) are parsed by ``config.devices``, re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from megatron_rl.config.devices import DeviceAssignment, engine_devices, parse_device
from megatron_rl.config.fields import require_values
from megatron_rl.config.schema import DType, ModelConfig, RolloutConfig
from megatron_rl.config.sections import require_valid

__all__ = ["DeviceAssignment", "EngineSettings", "parse_device"]


@dataclass(frozen=True, kw_only=True)
class EngineSettings(RolloutConfig):
    """How to build a rollout engine pool: ``rollout`` as configured, plus the fields below."""

    model_path: str  # HF checkpoint the engines start from (model.hf_path, or a resumed checkpoint's model)
    model_dtype: DType = ModelConfig.dtype  # model.dtype: the engines' dtype when rollout.dtype is None
    worker_env: Mapping[str, str] = field(default_factory=dict)  # extra environment of the worker processes
    return_routed_experts: bool = False  # algorithm.routing_replay 'rollout': engines return MoE routes
    initial_version: int = 0  # the version of the weights at model_path: a resumed checkpoint's step
    # pipeline.max_staleness: with in_flight_updates, an update restarts a request that started more
    # versions back than this (rollout.in_flight)
    max_staleness: int = 0

    def __post_init__(self) -> None:
        require_valid(self, "rollout")
        require_values({"model.dtype": self.model_dtype})

    @property
    def engine_dtype(self) -> str:
        """Weights and compute dtype inside the engines."""
        return self.dtype or self.model_dtype

    def device_assignments(self) -> tuple[DeviceAssignment, ...]:
        """One ``DeviceAssignment`` per worker (the strings were checked at construction)."""
        return engine_devices(self.devices, self.num_engines)
