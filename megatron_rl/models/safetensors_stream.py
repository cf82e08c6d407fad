"""Write a safetensors file one tensor at a time, so a saving rank never holds all of them.

safetensors' own ``save_file`` takes every tensor at once. The format
(https://github.com/huggingface/safetensors, "Format") is: an 8-byte little-endian unsigned
length N, N bytes of JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}`` (may be padded with spaces), then the tensors' raw bytes;
offsets are relative to the end of the header, contiguous and cover the rest of the file.
Knowing every tensor's name, dtype and shape in advance, ``SafetensorsStream`` writes the
header first and appends each tensor's bytes as it arrives, in the declared order. The file
reads back with ``safetensors.safe_open``.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ALIGN = 8  # safetensors pads its header so the data starts 8-byte aligned; we do the same


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file as the header declares it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _header(entries: Sequence[TensorEntry], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for e in entries:
        if e.dtype not in _DTYPES:
            raise ValueError(f"safetensors: tensor {e.name!r} has dtype {e.dtype}, which the format cannot store")
        if e.name in header:
            raise ValueError(f"safetensors: tensor name {e.name!r} appears twice")
        header[e.name] = {
            "dtype": _DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-(len(raw) + 8) % _ALIGN)


class SafetensorsStream:
    """Writer of ``path``: header at construction, then ``write`` each declared tensor in order,
    then ``close`` (or use it as a context manager). On an error inside the ``with`` block the
    partial file is removed."""

    def __init__(self, path: str | Path, entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None):
        if sys.byteorder != "little":  # the format is little-endian; tensors are written as in memory
            raise RuntimeError("safetensors streaming needs a little-endian host")
        self.path, self.entries, self._next = Path(path), tuple(entries), 0
        header = _header(self.entries, metadata)
        self._file = self.path.open("wb")
        self._file.write(struct.pack("<Q", len(header)) + header)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (any device; copied to the host one tensor at a time) as ``name``."""
        if self._next >= len(self.entries):
            raise ValueError(f"{self.path}: tensor {name!r} written after the {len(self.entries)} declared ones")
        e = self.entries[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (e.name, e.dtype, e.shape):
            raise ValueError(
                f"{self.path}: got {name!r} {tensor.dtype} {tuple(tensor.shape)}, the header declares "
                f"{e.name!r} {e.dtype} {e.shape} next"
            )
        host = tensor.detach().to("cpu").contiguous().reshape(-1)
        self._file.write(host.view(torch.uint8).numpy().data)  # the tensor's own bytes, no extra copy
        self._next += 1

    def close(self) -> None:
        """Flush and close; ``ValueError`` naming the first tensor never written (the file is removed)."""
        if self._file.closed:
            return
        if self._next != len(self.entries):
            self.abort()
            raise ValueError(f"{self.path}: closed before tensor {self.entries[self._next].name!r} was written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        """Close and remove the partial file."""
        self._file.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
