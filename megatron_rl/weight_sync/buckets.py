"""Flat buckets for weight sync: many HF-named tensors packed into few large 1-D buffers.

A collective per tensor costs a round trip each (~300 tensors for a 0.5 GB model, ~340 for a
7B one); a few buffers of ``rollout.sync_bucket_mb`` each move at the link's bandwidth.

Contract: sender and receivers compute the same ``plan_buckets(specs, bucket_bytes)`` from the
announced ``TensorSpec`` list, so only the specs travel ahead of the data. Tensors are grouped
by dtype (one dtype per bucket, first-appearance order, spec order inside a dtype); a tensor
that does not fit in the rest of a bucket is split across consecutive buckets, so a tensor
larger than a bucket is fine. ``pack`` fills a bucket's buffer on the sender; ``Unpacker``
turns received buffers back into ``(name, tensor)`` pairs: a tensor wholly inside one bucket
is a view of that buffer (no copy), a split one is assembled into a tensor of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

MB = 1 << 20


@contextmanager
def one_copy_thread() -> Iterator[None]:
    """Run weight-sync memory copies on one intra-op thread. Measured on a 2-core machine
    shared with other jobs, 0.54 GB copied tensor by tensor: 0.05 CPU-s on one thread (~10 GB/s),
    ~1 CPU-s with two OpenMP threads (they spin while waiting for each other). A copy is
    bound by memory bandwidth, which one thread already saturates. (A vLLM CPU worker's
    oneDNN repack after the copies goes back to the engine's own thread count: a packed copy
    is only right for the count it was made with, ``platform.patches.vllm_cpu_weights``.)

    ``torch._C.set_num_threads`` is torch's own setter: vLLM's CPU worker replaces
    ``torch.set_num_threads`` with a stub that refuses after it has bound its OpenMP threads
    to cores. Going down to one thread and back to the same count starts no new (unbound)
    thread, so the binding holds."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch._C.set_num_threads(1)
    try:
        yield
    finally:
        torch._C.set_num_threads(threads)


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one synced tensor, announced before the data."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "torch.float32"

    @staticmethod
    def of(name: str, tensor: torch.Tensor) -> TensorSpec:
        return TensorSpec(name, tuple(tensor.shape), str(tensor.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.removeprefix("torch."))

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + numel)`` of tensor ``index`` (flattened) at ``offset`` of a bucket."""

    index: int  # position in the spec list
    start: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """One flat buffer of ``numel`` elements of ``dtype`` and the tensor pieces it carries."""

    dtype: str
    numel: int
    pieces: tuple[Piece, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.removeprefix("torch."))

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Buckets of at most ``bucket_bytes`` (at least one element) covering every spec once."""
    if bucket_bytes < 1:
        raise ValueError(f"rollout.sync_bucket_mb: bucket size {bucket_bytes} bytes must be >= 1")
    by_dtype: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        by_dtype.setdefault(spec.dtype, []).append(i)
    buckets: list[Bucket] = []
    for dtype, indices in by_dtype.items():
        capacity = max(1, bucket_bytes // specs[indices[0]].torch_dtype.itemsize)
        pieces: list[Piece] = []
        used = 0
        for i in indices:
            start, total = 0, specs[i].numel
            if total == 0:  # announced, so the receiver still yields it
                pieces.append(Piece(i, 0, used, 0))
            while start < total:
                n = min(total - start, capacity - used)
                pieces.append(Piece(i, start, used, n))
                start, used = start + n, used + n
                if used == capacity:
                    buckets.append(Bucket(dtype, used, tuple(pieces)))
                    pieces, used = [], 0
        if pieces:
            buckets.append(Bucket(dtype, used, tuple(pieces)))
    return buckets


class BufferRing:
    """``slots`` flat buffers reused bucket after bucket (and sync after sync): a fresh
    allocation of a large buffer costs page faults and zeroing on every use on CPU. Bucket k
    goes to slot k % slots, so the previous bucket's buffer stays valid while this one fills."""

    def __init__(self, slots: int = 2):
        self._raw: list[torch.Tensor | None] = [None] * slots

    def get(self, index: int, bucket: Bucket, device: torch.device) -> torch.Tensor:
        slot = index % len(self._raw)
        raw = self._raw[slot]
        if raw is None or raw.numel() < bucket.nbytes or raw.device != device:
            raw = self._raw[slot] = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        return raw[: bucket.nbytes].view(bucket.torch_dtype)


def pack(bucket: Bucket, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's flat buffer (``out``, or a new one on the tensors' device) filled from
    ``tensors`` (in spec order; a device tensor packed into a host ``out`` is copied to host).
    A bucket that is one whole contiguous tensor on ``out``'s device is that tensor's own
    storage (no copy)."""
    device = out.device if out is not None else tensors[bucket.pieces[0].index].device
    if len(bucket.pieces) == 1:
        (p,) = bucket.pieces
        t = tensors[p.index]
        if p.start == 0 and p.numel == t.numel() and t.is_contiguous() and t.device == device:
            return t.reshape(-1)
    buffer = out if out is not None else torch.empty(bucket.numel, dtype=bucket.torch_dtype, device=device)
    for p in bucket.pieces:
        buffer[p.offset : p.offset + p.numel].copy_(tensors[p.index].reshape(-1)[p.start : p.start + p.numel])
    return buffer


class Unpacker:
    """Receiver side: ``feed`` each bucket's buffer in plan order; yields finished tensors."""

    def __init__(self, specs: Sequence[TensorSpec]):
        self._specs = specs
        self._partial: dict[int, torch.Tensor] = {}  # split tensors being assembled

    def feed(self, bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for p in bucket.pieces:
            spec = self._specs[p.index]
            piece = buffer[p.offset : p.offset + p.numel]
            if p.start == 0 and p.numel == spec.numel:
                yield spec.name, piece.view(spec.shape)
                continue
            if p.start == 0:
                self._partial[p.index] = torch.empty(spec.numel, dtype=spec.torch_dtype, device=buffer.device)
            self._partial[p.index][p.start : p.start + p.numel].copy_(piece)
            if p.start + p.numel == spec.numel:
                yield spec.name, self._partial.pop(p.index).view(spec.shape)
