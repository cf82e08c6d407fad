"""``rollout.weight_sync: shared_memory``: weight sync through shared memory, one machine.

Each pipeline stage's sender (TP rank 0 of the stage, DP replica 0) copies its HF-named
tensors, device tensors to host, into a flat file of its own in ``/dev/shm``
(``SharedWeightsWriter``: two files used in turn, each mapped once and rewritten
in place, so after the first two syncs no page is allocated again); the engine workers map
the same files (``read_shared``, mappings kept between syncs) and copy the tensors straight
from them into their model: one memory copy on each side, no socket, no serialisation, no file parsing.
``SharedLayout`` (path, specs, byte offsets) is all that travels through the worker pipes:
the senders' layouts are gathered on the replica channel, in stage order, and the leader's
engine loads them (``SharedMemoryUpdate``). No rank holds more than its stage.

Contract: the file of a version stays unchanged until the sync after next (the pool's lock
orders syncs and generation), so a worker restarted between syncs, or during a generate of
the previous version while the next one is written (stale mode), loads it again; at PP > 1 the
layouts of every stage are loaded in stage order. Engines must run on the machine of every
sender (for engines elsewhere use ``broadcast``).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from megatron_rl.weight_sync.base import (
    SenderSetup,
    SyncStats,
    TensorLoader,
    UpdateTensors,
    WeightUpdate,
    WorkerLoad,
    all_gather,
)
from megatron_rl.weight_sync.buckets import TensorSpec, one_copy_thread

ALIGN = 64  # byte alignment of each tensor in the file (any dtype view is legal, cache-line starts)


@dataclass(frozen=True)
class SharedLayout:
    """Where one sender's tensors lie: the file, and each tensor's spec and byte offset."""

    path: str
    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int  # the file's size

    @property
    def tensor_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def plan_layout(path: str, specs: Sequence[TensorSpec]) -> SharedLayout:
    """Offsets of ``specs`` packed one after another, each aligned to ``ALIGN`` bytes."""
    offsets, end = [], 0
    for spec in specs:
        offsets.append(end)
        end += -(-spec.nbytes // ALIGN) * ALIGN
    return SharedLayout(path, tuple(specs), tuple(offsets), max(end, ALIGN))


class _Mapping:
    """A file mapped read-write as one uint8 tensor."""

    def __init__(self, path: str, nbytes: int, *, create: bool):
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise ValueError(f"{path}: {os.fstat(fd).st_size} bytes, the layout needs {nbytes}")
            self._mm = mmap.mmap(fd, nbytes)
            self.inode = os.fstat(fd).st_ino  # a file re-created at the same path is another file
        finally:
            os.close(fd)  # the mapping keeps the file
        self.path, self.nbytes = path, nbytes
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)

    def view(self, spec: TensorSpec, offset: int) -> torch.Tensor:
        return self.tensor[offset : offset + spec.nbytes].view(spec.torch_dtype).view(spec.shape)


class SharedWeightsWriter:
    """Sender side: writes tensors into ``<path>.0`` and ``<path>.1`` in turn (each created, or
    resized when the tensor set changes), returning the layout the workers map.

    Two files, because the write of version v+1 starts before the pool's lock is taken: in
    stale mode a worker restarted during a generate of version v must still find v. The file
    of v is rewritten only by the write of v+2, after every worker has loaded v+1."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self._mappings: dict[str, _Mapping] = {}
        self._writes = 0

    def write(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> SharedLayout:
        path = f"{self.path}.{self._writes % 2}"
        self._writes += 1
        layout = plan_layout(path, [TensorSpec.of(n, t) for n, t in named_tensors])
        mapping = self._mappings.get(path)
        if mapping is None or mapping.nbytes != layout.nbytes or not os.path.exists(path):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            mapping = self._mappings[path] = _Mapping(path, layout.nbytes, create=True)
        with one_copy_thread():
            for (_, t), spec, offset in zip(named_tensors, layout.specs, layout.offsets, strict=True):
                mapping.view(spec, offset).copy_(t)  # device -> host copy where t lives on a device
        return layout


def read_shared(layout: SharedLayout, cache: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Worker side: ``(name, tensor)`` views of the file at ``layout.path`` (copy before the
    next sync: the sender rewrites the file in place); ``cache`` keeps mappings between calls."""
    try:
        inode = os.stat(layout.path).st_ino
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"rollout.weight_sync=shared_memory: {layout.path} is not on this machine; the engines must "
            "run on the machine of every pipeline stage's sender (use 'broadcast' otherwise)"
        ) from err
    cache = {} if cache is None else cache
    mapping = cache.get(layout.path)
    if mapping is None or mapping.nbytes != layout.nbytes or mapping.inode != inode:
        mapping = cache[layout.path] = _Mapping(layout.path, layout.nbytes, create=False)
    for spec, offset in zip(layout.specs, layout.offsets, strict=True):
        yield spec.name, mapping.view(spec, offset)


@dataclass(frozen=True)
class SharedMemoryUpdate(WeightUpdate, WorkerLoad):
    """Load every stage's file, in stage order (its own worker message; a restarted worker
    loads it again: the files hold the version until the sync after next); ``partial``: some of
    the model's weights, the engine keeps the others (``base``)."""

    transport: ClassVar[str] = "shared_memory"
    layouts: tuple[SharedLayout, ...]
    partial: bool = False

    def payload(self) -> SharedMemoryUpdate:
        return self


class Sender:
    """Write this stage's file (one writer per stage), gather the layouts, have the engine load them."""

    def __init__(self, setup: SenderSetup):
        self.setup = setup
        place = setup.place
        self._writer = (
            SharedWeightsWriter(Path(setup.scratch) / f"weights-stage{place.stage}.bin") if place.sends else None
        )  # rewritten in place every sync

    def sync(self, version: int) -> SyncStats:
        s = self.setup
        tensors = s.source.export()  # collective over this stage's TP group
        layout = self._writer.write(tensors) if self._writer is not None else None
        del tensors
        entries = [e for e in all_gather(s.channel, (s.place.stage, layout)) if e[1] is not None]
        layouts = tuple(lay for _, lay in sorted(entries, key=lambda e: e[0]))
        if s.engine is not None:
            s.engine.load_weights(SharedMemoryUpdate(layouts, partial=s.source.partial), version)
        return SyncStats(sum(lay.tensor_bytes for lay in layouts))


class Receiver:
    """Worker side: copy every stage's tensors from the mapped files (mappings kept)."""

    def __init__(self) -> None:
        self._mappings: dict[str, _Mapping] = {}

    def receive(self, load: SharedMemoryUpdate, backend: TensorLoader) -> None:
        with one_copy_thread():
            items = (item for layout in load.layouts for item in read_shared(layout, self._mappings))
            backend.load_tensors(UpdateTensors(items, partial=load.partial))
