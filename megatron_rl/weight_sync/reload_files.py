"""Received HF tensors streamed into safetensors files, for an engine that reloads its weights
from a directory (vLLM at tensor-parallel size > 1: every TP rank is a process of vLLM's own
and reads the files itself; ``rollout.backends.vllm``).

Contract: ``write_shards`` takes each ``(name, tensor)`` pair, copies it to host memory before
asking for the next (so a receiver may reuse its device buffers: ``streams_weights``), and
writes ``model-NNNNN.safetensors`` files of about ``shard_bytes`` each into the directory. The
engine's device never holds more than the receiver's buffers; host memory holds one shard
besides the files. Each byte is written to a file once.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from megatron_rl.models.safetensors_stream import SafetensorsStream, TensorEntry

SHARD_BYTES = 256 << 20  # host memory held before a shard is written


def write_shards(
    named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str | Path, shard_bytes: int = SHARD_BYTES
) -> list[Path]:
    """Write ``named_tensors`` (any device) into safetensors files in ``directory``, holding at
    most ``shard_bytes`` (or one larger tensor) on the host at a time; returns the files."""
    pending: list[tuple[str, torch.Tensor]] = []
    files: list[Path] = []
    held = 0
    for name, tensor in named_tensors:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        host.copy_(tensor)  # a copy even of a host tensor: the receiver reuses its buffers
        pending.append((name, host))
        held += host.nbytes
        if held >= shard_bytes:
            files.append(_write(pending, Path(directory), len(files)))
            pending, held = [], 0
    if pending or not files:
        files.append(_write(pending, Path(directory), len(files)))
    return files


def _write(named: list[tuple[str, torch.Tensor]], directory: Path, index: int) -> Path:
    path = directory / f"model-{index + 1:05d}.safetensors"
    entries = [TensorEntry(n, t.dtype, tuple(t.shape)) for n, t in named]
    with SafetensorsStream(path, entries, {"format": "pt"}) as out:
        for name, tensor in named:
            out.write(name, tensor)
    return path
