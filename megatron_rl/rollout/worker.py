"""The body of one engine worker process, and the messages it exchanges with its pool.

Each worker owns one duplex pipe to the parent and has at most one command outstanding:

    parent -> worker: Generate(requests) | LoadWeights(snapshot_dir, version) | Stop()
                      | JoinSyncGroup(addresses, rank) | ReceiveWeights(version, sources, bucket_bytes)
                      | LoadShared(version, layouts)
    worker -> parent: Ready(version)                     once, after start-up
                      Result(result)* then Done()        for Generate (one Result per request)
                      Loaded(version)                    for LoadWeights, ReceiveWeights, JoinSyncGroup,
                                                         LoadShared
                      Failed(request_ids, error)         instead of Done / Loaded / Ready

A pipe per worker (not a shared queue) means a worker killed mid-write can corrupt nothing
but its own pipe, which the pool throws away. The worker strips torchrun's environment
(vLLM hangs inside a torchrun rank otherwise), pins itself to its device set, then imports
its backend: heavy imports happen only in the child.
"""

from __future__ import annotations

import importlib
import os
import traceback
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_rl.rollout.settings import DeviceAssignment
from megatron_rl.rollout.types import GenerationRequest, GenerationResult

# Variables torchrun / torch elastic set for a training rank; a worker is never such a rank.
TORCHRUN_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
)
VISIBLE_DEVICES_VAR = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
BACKEND_CLASSES = {
    "hf": "megatron_rl.rollout.hf_worker:HFBackend",
    "vllm": "megatron_rl.rollout.vllm_worker:VLLMBackend",
}


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What a worker process needs to build its backend (pickled into the child)."""

    index: int
    backend: str  # a key of BACKEND_CLASSES, or "package.module:Class"
    model_path: str
    device: DeviceAssignment
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    max_batch_size: int = 16
    seed: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    backend_kwargs: Mapping[str, Any] = field(default_factory=dict)


class WorkerBackend(Protocol):
    """A generation engine living inside one worker process (built as ``Class(spec)``)."""

    def load_weights(self, snapshot_dir: str) -> None:
        """Replace the weights in place with the HF safetensors in ``snapshot_dir``."""
        ...

    def generate(self, requests: Sequence[GenerationRequest], weight_version: int) -> Iterator[GenerationResult]:
        """Yield exactly one result per request, each stamped with ``weight_version``."""
        ...

    def load_tensors(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Replace the weights in place with HF-named tensors (every parameter exactly once).
        A backend whose class sets ``streams_weights = True`` copies each tensor before taking
        the next (its receive buffers are then reused)."""
        ...

    @property
    def device(self) -> Any:
        """The torch device the model's weights live on (receive buffers are allocated there)."""
        ...


@dataclass(frozen=True)
class Generate:
    requests: tuple[GenerationRequest, ...]


@dataclass(frozen=True)
class LoadWeights:
    snapshot_dir: str
    version: int


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class JoinSyncGroup:
    addresses: tuple  # broadcast.GroupAddress of each sender's group (one per PP stage), in order
    rank: int  # this worker's rank in every one of them


@dataclass(frozen=True)
class ReceiveWeights:
    version: int
    sources: tuple  # per group (JoinSyncGroup order): the broadcast.TensorSpec tuple its sender sends
    bucket_bytes: int  # rollout.sync_bucket_mb in bytes (both sides plan the same buckets)


@dataclass(frozen=True)
class LoadShared:
    version: int
    layouts: tuple  # shared_weights.SharedLayout per sender (PP stage), in stage order


@dataclass(frozen=True)
class Ready:
    version: int


@dataclass(frozen=True)
class Result:
    result: GenerationResult


@dataclass(frozen=True)
class Done:
    pass


@dataclass(frozen=True)
class Loaded:
    version: int


@dataclass(frozen=True)
class Failed:
    request_ids: tuple[str, ...]
    error: str  # formatted traceback from the worker


def prepare_process(device: DeviceAssignment, env: Mapping[str, str]) -> None:
    """Strip torchrun's variables, apply ``env``, and restrict this process to ``device``."""
    for name in list(os.environ):
        if name in TORCHRUN_VARS or name.startswith("TORCHELASTIC_"):
            del os.environ[name]
    os.environ.update(env)
    if device.kind in VISIBLE_DEVICES_VAR:
        os.environ[VISIBLE_DEVICES_VAR[device.kind]] = ",".join(map(str, device.ids))
    elif device.ids:
        os.sched_setaffinity(0, device.ids)
        os.environ["OMP_NUM_THREADS"] = str(len(device.ids))


def build_backend(spec: WorkerSpec) -> WorkerBackend:
    """Import and construct the backend class that ``spec.backend`` names."""
    module_name, _, class_name = BACKEND_CLASSES.get(spec.backend, spec.backend).partition(":")
    return getattr(importlib.import_module(module_name), class_name)(spec)


def worker_main(spec: WorkerSpec, conn, snapshot_dir: str | None, version: int) -> None:
    """Process entry point: build the backend (loading ``snapshot_dir`` if given), then serve."""
    prepare_process(spec.device, spec.env)
    try:
        backend = build_backend(spec)
        if snapshot_dir is not None:
            backend.load_weights(snapshot_dir)
    except Exception:  # reported to the parent, which raises it there
        conn.send(Failed((), traceback.format_exc()))
        return
    conn.send(Ready(version))
    _serve(backend, conn, version)


def _sync_command(backend: WorkerBackend, command, group_box: list, version: int) -> int:
    """Join the broadcast groups, receive a weight version through them, or load one from
    shared memory; returns the version."""
    from megatron_rl.rollout.broadcast import make_group, receive_tensors
    from megatron_rl.rollout.buckets import BufferRing, one_copy_thread

    if isinstance(command, JoinSyncGroup):
        group_box[:] = [make_group(address, command.rank) for address in command.addresses]
        # Two receive buffers reused when the backend copies each tensor before taking the next.
        group_box.append(BufferRing(2) if getattr(backend, "streams_weights", False) else None)
        return version
    if isinstance(command, LoadShared):
        from megatron_rl.rollout.shared_weights import read_shared

        with one_copy_thread():
            backend.load_tensors(item for layout in command.layouts for item in read_shared(layout))
        return command.version
    *groups, ring = group_box or [None]
    if len(groups) != len(command.sources):
        raise RuntimeError(f"ReceiveWeights from {len(command.sources)} senders, but {len(groups)} groups joined")
    device = backend.device
    with one_copy_thread():
        backend.load_tensors(
            item for group, specs in zip(groups, command.sources, strict=True)
            for item in receive_tensors(group, specs, command.bucket_bytes, device, ring)
        )
    return command.version


def _serve(backend: WorkerBackend, conn, version: int) -> None:
    from megatron_rl.rollout.buckets import one_copy_thread

    group_box: list = []  # the broadcast sync groups, once joined, then the receive BufferRing
    while True:
        try:
            command = conn.recv()
        except EOFError:  # the parent is gone
            return
        if isinstance(command, Stop):
            return
        if isinstance(command, LoadWeights):
            try:
                with one_copy_thread():
                    backend.load_weights(command.snapshot_dir)
            except Exception:
                conn.send(Failed((), traceback.format_exc()))
                continue
            version = command.version
            conn.send(Loaded(version))
        elif isinstance(command, (JoinSyncGroup, ReceiveWeights, LoadShared)):
            try:
                version = _sync_command(backend, command, group_box, version)
            except Exception:
                conn.send(Failed((), traceback.format_exc()))
                continue
            conn.send(Loaded(version))
        elif isinstance(command, Generate):
            try:
                for result in backend.generate(command.requests, version):
                    conn.send(Result(result))
            except Exception:
                conn.send(Failed(tuple(r.request_id for r in command.requests), traceback.format_exc()))
                continue
            conn.send(Done())
