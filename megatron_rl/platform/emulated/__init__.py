"""The ``emulated`` accelerator: a PrivateUse1 device backed by host memory, so that CUDA's device
rules hold in CPU-only tests.

Tensors live on ``emulated:0``, ``emulated:1``, … (``MEGATRON_RL_EMULATED_DEVICES`` devices,
16 by default); ops run the CPU kernels on zero-copy aliases, but an op that mixes a host
tensor of dim > 0 with device tensors raises CUDA's "Expected all tensors to be on the same
device" error, and the collective backend ``eccl`` (gloo underneath) takes device tensors
only. Host<->device copies, including ``.item()``, are counted (``transfer_counts()``).

``load()`` builds (first time) and registers everything; ``setup_platform("emulated")`` calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import timedelta

import torch

DEVICE_TYPE = "emulated"
BACKEND = "eccl"

_STATE: dict[str, object] = {}


@dataclass(frozen=True)
class TransferCounts:
    """Host->device and device->host copies (a scalar read counts as one d2h) and their bytes."""

    h2d: int = 0
    d2h: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0

    def __sub__(self, other: TransferCounts) -> TransferCounts:
        return TransferCounts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


def load():
    """Build / load the extension and register the device, its methods and ``eccl`` (idempotent)."""
    if "ext" in _STATE:
        return _STATE["ext"]
    from megatron_rl.platform.emulated.build import load_extension

    ext = load_extension()
    ext.register_direct_ops()
    torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
    if not hasattr(torch, DEVICE_TYPE):
        from megatron_rl.platform.emulated import device_module

        torch._register_device_module(DEVICE_TYPE, device_module)
    if not hasattr(torch.Tensor, DEVICE_TYPE):
        torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    _register_collectives(ext)
    _STATE["ext"] = ext
    return ext


def is_loaded() -> bool:
    return "ext" in _STATE


def transfer_counts() -> TransferCounts:
    """Copies between host and the emulated devices since the start (or the last reset)."""
    if not is_loaded():
        return TransferCounts()
    return TransferCounts(*_STATE["ext"].transfer_counts())


def reset_transfer_counts() -> None:
    if is_loaded():
        _STATE["ext"].reset_transfer_counts()


def _register_collectives(ext) -> None:
    import torch.distributed as dist

    if BACKEND.upper() in dist.Backend._plugins:
        return

    def create(store, rank: int, world_size: int, timeout: timedelta):
        inner = dist.ProcessGroupGloo(dist.PrefixStore(f"{BACKEND}-gloo/", store), rank, world_size, timeout)
        inner._set_sequence_number_for_group()
        return ext.CollectiveBackend(inner)

    dist.Backend.register_backend(BACKEND, create, devices=[DEVICE_TYPE])
