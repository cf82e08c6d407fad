"""Typed settings of a rollout engine pool, device strings, and their validation.

``EngineSettings`` *is* the ``rollout`` config section (it extends ``RolloutConfig``: every
knob, its name and its default are declared once, in the schema) plus what the run resolves:
the checkpoint the engines start from, the model's dtype, extra worker environment.
``rollout.devices`` holds one string per engine (worker): ``"cpu"`` (no pinning), ``"cpu:1"`` /
``"cpu:0-1"`` / ``"cpu:0,2"`` (pin the worker to those cores, so the trainer and the engines own
separate cores), ``"cuda:0"`` / ``"cuda:0,1"`` or ``"npu:3"`` (the visible devices of that
worker; one per tensor-parallel rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.schema import DType, ModelConfig, RolloutConfig

BACKENDS = ("hf", "vllm")
DTYPES = ("float32", "bfloat16", "float16")
DEVICE_KINDS = ("cpu", "cuda", "npu")


@dataclass(frozen=True, kw_only=True)
class DeviceAssignment:
    """The device set of one worker: a kind and its ids (cores on CPU, device ordinals otherwise)."""

    kind: Literal["cpu", "cuda", "npu"]
    ids: tuple[int, ...] = ()  # empty on CPU: no pinning

    def __str__(self) -> str:
        return self.kind + (":" + ",".join(map(str, self.ids)) if self.ids else "")


def _parse_id_list(text: str, where: str) -> tuple[int, ...]:
    ids: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"{where}: bad id list {text!r} (expected e.g. '1', '0-3' or '0,2')")
        ids.extend(range(int(lo), int(hi or lo) + 1))
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: id list {text!r} repeats an id")
    return tuple(ids)


def parse_device(text: str, where: str = "rollout.devices") -> DeviceAssignment:
    """``"cpu"``, ``"cpu:0-1"``, ``"cuda:0,1"``, ``"npu:2"`` -> ``DeviceAssignment``."""
    kind, sep, rest = text.strip().partition(":")
    if kind not in DEVICE_KINDS:
        raise ValueError(f"{where}: device {text!r} must start with one of {DEVICE_KINDS}")
    if kind != "cpu" and not rest:
        raise ValueError(f"{where}: device {text!r} must name its ids, e.g. '{kind}:0'")
    return DeviceAssignment(kind=kind, ids=_parse_id_list(rest, where) if sep else ())


@dataclass(frozen=True, kw_only=True)
class EngineSettings(RolloutConfig):
    """How to build a rollout engine pool: ``rollout`` as configured, plus the fields below."""

    model_path: str  # HF checkpoint the engines start from (model.hf_path, or a resumed checkpoint's model)
    model_dtype: DType = ModelConfig.dtype  # model.dtype: the engines' dtype when rollout.dtype is None
    worker_env: Mapping[str, str] = field(default_factory=dict)  # extra environment of the worker processes

    @property
    def engine_dtype(self) -> str:
        """Weights and compute dtype inside the engines."""
        return self.dtype or self.model_dtype

    def device_assignments(self) -> tuple[DeviceAssignment, ...]:
        """One ``DeviceAssignment`` per worker (validated)."""
        self.validate()
        return self._assignments()

    def _assignments(self) -> tuple[DeviceAssignment, ...]:
        if not self.devices:
            return tuple(DeviceAssignment(kind="cpu") for _ in range(self.num_engines))
        return tuple(parse_device(d, f"rollout.devices[{i}]") for i, d in enumerate(self.devices))

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field for any bad value."""
        if self.engine not in BACKENDS:
            raise ValueError(f"rollout.engine={self.engine!r} must be one of {BACKENDS}")
        if self.engine_dtype not in DTYPES:
            raise ValueError(f"rollout.dtype={self.engine_dtype!r} must be one of {DTYPES}")
        for name in ("num_engines", "tensor_parallel_size", "max_batch_size", "sync_bucket_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)} must be >= 1")
        if self.weight_sync not in ("snapshot", "broadcast", "shared_memory"):
            raise ValueError(f"rollout.weight_sync={self.weight_sync!r} must be 'snapshot', 'broadcast' "
                             "or 'shared_memory'")
        for name in ("start_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rollout.{name}={getattr(self, name)} must be > 0")
        if self.max_restarts < 0:
            raise ValueError(f"rollout.max_restarts={self.max_restarts} must be >= 0")
        if self.devices and len(self.devices) != self.num_engines:
            raise ValueError(
                f"rollout.devices has {len(self.devices)} entries but rollout.num_engines={self.num_engines}: "
                "give one device string per engine"
            )
        for i, dev in enumerate(self._assignments()):
            if dev.kind == "cpu" and self.tensor_parallel_size != 1:
                raise ValueError(
                    f"rollout.tensor_parallel_size={self.tensor_parallel_size} with CPU worker {i}: use 1 on CPU"
                )
            if dev.kind != "cpu" and len(dev.ids) != self.tensor_parallel_size:
                raise ValueError(
                    f"rollout.devices[{i}]={str(dev)!r} names {len(dev.ids)} devices but "
                    f"rollout.tensor_parallel_size={self.tensor_parallel_size}"
                )
        if self.engine == "hf" and self.tensor_parallel_size != 1:
            raise ValueError("rollout.tensor_parallel_size must be 1 with rollout.engine='hf'")
