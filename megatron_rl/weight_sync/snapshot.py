"""``rollout.weight_sync: snapshot``: every rank writes its share of a HF safetensors checkpoint
(``WeightSource.save``) into ``<scratch>/v<version>``; the engine's workers read it.

Needs no group and no shared memory, so it survives anything: a worker restarted at any time
loads the current directory at start. The last two directories are kept (a worker restarted
during a generate of version v - 1 in stale mode still finds it).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from megatron_rl.weight_sync.base import SenderSetup, SyncStats, TensorLoader, UpdateTensors, WeightUpdate, WorkerLoad


@dataclass(frozen=True)
class SnapshotUpdate(WeightUpdate, WorkerLoad):
    """Load the HF safetensors in ``path`` (its own worker message); ``partial``: they are some
    of the model's weights, the engine keeps the others (``base``)."""

    transport: ClassVar[str] = "snapshot"
    path: str
    partial: bool = False

    def payload(self) -> SnapshotUpdate:
        return self


class Sender:
    """Write the snapshot (collective over every rank), then have the engine load it."""

    def __init__(self, setup: SenderSetup):
        self.setup = setup

    def sync(self, version: int) -> SyncStats:
        s = self.setup
        directory = Path(s.scratch) / f"v{version}"
        s.source.save(directory)  # device tensors are copied to host by the writer
        nbytes = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        if s.engine is not None:
            s.engine.load_weights(SnapshotUpdate(str(directory), partial=s.source.partial), version)
            shutil.rmtree(Path(s.scratch) / f"v{version - 2}", ignore_errors=True)  # keep two
        return SyncStats(nbytes)


def read_snapshot(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every safetensors file in ``path`` (mapped, read lazily)."""
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class Receiver:
    """Worker side: stream the snapshot's tensors into the backend (or have it reload the directory)."""

    def receive(self, load: SnapshotUpdate, backend: TensorLoader) -> None:
        if not Path(load.path).is_dir():
            raise FileNotFoundError(f"weight snapshot {load.path!r} is not a directory on this machine")
        # a backend that reloads from files (vLLM at TP > 1) reads ``directory`` itself
        backend.load_tensors(UpdateTensors(read_snapshot(load.path), partial=load.partial, directory=load.path))
