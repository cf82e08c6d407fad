"""The weight-sync contract: a sender on the trainer ranks, an update the engine takes, a
receiver in each engine worker, and the registry that builds them from a transport name.

- ``WeightSender`` (one per rank, built once at set-up by ``build_sender``): ``sync(version)``
  is called on every rank of a replica in the same order (``Replica.sync_weights``); it
  exports this rank's HF tensors (``WeightSource``), moves them, and on the rank that owns
  the engine hands it one ``WeightUpdate``; the other ranks' part of the sync (PP > 1
  stages) is driven by the sender itself over the replica ``Channel``.
- ``WeightUpdate``: what ``RolloutEngine.load_weights(update, version)`` takes, the engine's
  one weight-loading entry point. The pool calls ``update.deliver(fanout)`` with a ``Fanout``
  (its supervised workers), ``update.at_start()`` for a worker started later, and
  ``update.after_restart(fanout, worker)`` when one is restarted between syncs.
- ``WorkerLoad``: the picklable message a worker gets; ``build_receiver(load.transport)``
  makes the worker's ``WeightReceiver`` for it (kept for the worker's life), which feeds
  ``(name, tensor)`` pairs to the backend's ``load_tensors`` (``TensorLoader``) as ``UpdateTensors``.
- Partial updates: a source whose ``partial`` is set (a LoRA policy: only the adapted layers'
  merged weights change) exports and saves those tensors alone; its messages say so, and the
  backend copies them and keeps every other weight as it was (the engines start from the base
  checkpoint, which holds them). A full update must cover every weight (the backend checks).

A transport is a module of this package named as in the schema's ``WeightSync`` Literal,
holding ``Sender`` and ``Receiver`` classes: the registry imports it by that name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, get_args

import torch

from megatron_rl.config.schema import WeightSync

TRANSPORTS: tuple[str, ...] = get_args(WeightSync)  # rollout.weight_sync names = module names here


@dataclass(frozen=True)
class SyncStats:
    """What one ``sync`` moved (on this rank's view)."""

    nbytes: int  # bytes of the HF tensors (or snapshot files) handed to the engines


@dataclass(frozen=True, kw_only=True)
class StagePlace:
    """Where this rank sits in its replica, as the senders need it."""

    stage: int = 0  # pipeline stage
    stages: int = 1  # pipeline stages (parallel.pp)
    sender: bool = True  # TP rank 0 of its stage: the one that sends the stage's tensors
    dp_rank: int = 0  # data-parallel replica (one writer per stage for shared memory)

    @property
    def sends(self) -> bool:
        """The rank that sends (or writes) its stage: TP rank 0 of DP replica 0. Only it holds
        the stage's full tensors (``WeightSource.export`` returns [] on every other rank)."""
        return self.sender and self.dp_rank == 0


class Channel(Protocol):
    """Leader -> ranks of one replica (``trainer.replica.ReplicaChannel``): a host group."""

    group: Any  # torch.distributed process group (gloo) of the replica's ranks
    size: int
    is_leader: bool

    def send(self, message: tuple[str, Any]) -> None: ...

    def recv(self) -> tuple[str, Any]: ...


class WeightSource(Protocol):
    """The policy as a sender reads it (``trainer.policy_weights``, or fixed tensors)."""

    @property
    def partial(self) -> bool:
        """``export`` / ``save`` hold only the weights that differ from the engines' starting
        checkpoint (the engines keep the others); False: every weight."""
        ...

    def export(self) -> list[tuple[str, torch.Tensor]]:
        """This stage's HF-named full tensors on the rank that sends them (``StagePlace.sends``;
        a rank-less source: everywhere), [] elsewhere (collective over the stage's TP group)."""
        ...

    def save(self, directory: Path) -> None:
        """Write a HF safetensors checkpoint of the policy into ``directory`` (every rank's share)."""
        ...


class Fanout(Protocol):
    """The pool's supervised workers, as an update delivers itself to them (``rollout.weight_delivery``)."""

    workers: list  # WorkerHandle of every worker
    version: int  # the version being delivered
    timeout_s: float  # bound of every wait on a worker, and of each collective
    max_restarts: int
    address: str  # interface the sync groups' listeners bind to (rollout.sync_address)
    group_backend: str  # gloo / nccl / hccl: what the workers' devices speak

    def run(self, commands: dict, what: str, collective: Callable[[], None] | None = None) -> list:
        """Send each worker its ``WorkerLoad`` (``commands``), run this process's side of
        ``collective``, wait for every answer; returns the workers that died and were restarted
        (with ``collective``: the caller repeats it; without: they loaded ``at_start``)."""
        ...

    def fail(self, message: str, cause: BaseException | None) -> None:
        """Raise ``RolloutWorkerError(message)``, marking the pool unusable (workers may differ)."""
        ...

    def give_up(self, message: str) -> None:
        """Raise ``RolloutWorkerError(message)`` (workers kept dying; the pool stays usable)."""
        ...


class WorkerLoad:
    """A message to one worker: load (or prepare to load) weights through ``transport``."""

    transport: ClassVar[str]
    loads: ClassVar[bool] = True  # False: a preparation step; the worker's version stays


class WeightUpdate:
    """What the engine's ``load_weights`` takes. Defaults: every worker loads ``payload``.
    ``partial``: some of the model's weights, the engine keeps the others; such an update may
    also complete the engine's current version (``trainer.replica.Replica.prime_engines``)."""

    transport: ClassVar[str]
    partial = False

    def payload(self) -> WorkerLoad:
        raise NotImplementedError

    def deliver(self, fanout: Fanout) -> None:
        """Make every worker load this update (restarted workers load it at start)."""
        fanout.run({w: self.payload() for w in fanout.workers}, f"load weights ({self.transport})")

    def at_start(self) -> WorkerLoad | None:
        """What a worker started after this update loads before it reports ready."""
        return self.payload()

    def after_restart(self, fanout: Fanout, worker) -> None:
        """A worker restarted between syncs (it loaded ``at_start``)."""


class UpdateTensors:
    """One update's ``(name, tensor)`` pairs as a receiver hands them to ``load_tensors``: an
    iterator, with ``partial`` (a subset of the model's weights: the backend keeps the others)
    and ``directory`` (the snapshot's files, for a backend that reloads from files; else None)."""

    def __init__(self, items: Iterable[tuple[str, torch.Tensor]], *, partial: bool, directory: str | None = None):
        self._items = iter(items)
        self.partial, self.directory = partial, directory

    def __iter__(self) -> UpdateTensors:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._items)


def is_partial(named_tensors: Iterable) -> bool:
    """Whether what ``load_tensors`` got is a partial update (``UpdateTensors.partial``); plain
    pairs are a full one."""
    return isinstance(named_tensors, UpdateTensors) and named_tensors.partial


class TensorLoader(Protocol):
    """The engine backend inside a worker (``rollout.worker.WorkerBackend``), as receivers use it."""

    streams_weights: bool  # copies each tensor before taking the next (receive buffers are reused)

    @property
    def device(self) -> torch.device: ...

    def load_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the tensors in; every weight unless ``is_partial(named_tensors)``."""
        ...


class WeightReceiver(Protocol):
    """One transport's side in a worker; lives as long as the worker (groups, mappings)."""

    def receive(self, load: WorkerLoad, backend: TensorLoader) -> None: ...


class WeightSender(Protocol):
    """One transport's side on a trainer rank; lives as long as the run."""

    def sync(self, version: int) -> SyncStats: ...


class Loader(Protocol):
    """Anything with the engine's entry point (``RolloutEngine``)."""

    def load_weights(self, update: WeightUpdate, version: int) -> None: ...


@dataclass(kw_only=True)
class SenderSetup:
    """Everything a sender is built from (``build_sender``)."""

    source: WeightSource
    engine: Loader | None = None  # on the rank that owns the engine pool; else None
    channel: Channel | None = None  # the replica's ranks; None: a single rank
    place: StagePlace = StagePlace()
    scratch: Path = Path("/dev/shm")  # snapshot directories and shared-memory files go here
    bucket_bytes: int = 256 << 20  # rollout.sync_bucket_mb, for bucketed transports


def _module(transport: str):
    if transport not in TRANSPORTS:
        raise ValueError(f"rollout.weight_sync={transport!r}: expected one of {list(TRANSPORTS)}")
    return importlib.import_module(f"megatron_rl.weight_sync.{transport}")


def build_sender(transport: str, setup: SenderSetup) -> WeightSender:
    """The ``Sender`` of module ``transport`` (a name of the schema's ``WeightSync``)."""
    return _module(transport).Sender(setup)


def build_receiver(transport: str) -> WeightReceiver:
    """The ``Receiver`` of module ``transport``, for an engine worker."""
    return _module(transport).Receiver()


def all_gather(channel: Channel, item: Any) -> list:
    """``item`` of every rank of ``channel``, in rank order (``[item]`` on a single rank)."""
    import torch.distributed as dist

    if channel is None or channel.size == 1:
        return [item]
    out: list = [None] * channel.size
    dist.all_gather_object(out, item, group=channel.group)
    return out


class TensorSource:
    """A ``WeightSource`` of fixed HF-named tensors (tools, tests, a rollout-only run);
    ``partial``: they are some of the model's weights only."""

    def __init__(self, named_tensors, *, partial: bool = False) -> None:
        self.named_tensors = list(named_tensors)
        self.partial = partial

    def export(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.named_tensors)

    def save(self, directory: Path) -> None:
        from safetensors.torch import save_file

        Path(directory).mkdir(parents=True, exist_ok=True)
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in self.named_tensors}  # host copy
        save_file(tensors, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})
