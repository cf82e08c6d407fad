"""The ``emulated`` accelerator: a PrivateUse1 device backed by host memory, so that CUDA's device
rules hold in CPU-only tests.

Tensors live on ``emulated:0``, ``emulated:1``, … (``MEGATRON_RL_EMULATED_DEVICES`` devices,
16 by default); ops run the CPU kernels on zero-copy aliases, but an op that mixes a host
tensor of dim > 0 with device tensors raises CUDA's "Expected all tensors to be on the same
device" error, and the collective backend ``eccl`` (gloo underneath) takes device tensors
only. Host<->device copies, including ``.item()``, are counted (``transfer_counts()``), and so
are the host syncs of data-dependent shapes (``nonzero``, ``unique``, ``x[mask]``: ``syncs``).

Two rule profiles (``profiles.py``, one table citing its sources) switch at run time in the
loaded extension: ``cuda`` (the default: NCCL-like collectives, fp64 allowed, H200 memory) and
``npu`` (Ascend 910B: no fp64 computed on the device, HCCL's collective dtypes / missing
collectives / contiguity, ``torch.npu.*`` type strings, 64 GiB per device). Each device has a
memory capacity (``set_memory_capacity``, ``$MEGATRON_RL_EMULATED_MEMORY_GB``) past which an
allocation raises ``torch.OutOfMemoryError``.

``load()`` builds (first time) and registers everything; ``setup_platform("emulated")`` calls it,
then ``set_profile``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Literal

import torch

from megatron_rl.platform.emulated.profiles import PROFILES, Profile

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
    syncs: int = 0  # data-dependent output sizes read back (each also one d2h)

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
    _apply(PROFILES[_STATE.get("profile", "cuda")])
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


ProfileName = Literal["cuda", "npu"]
MEMORY_ENV = "MEGATRON_RL_EMULATED_MEMORY_GB"
_ORIGINAL_TYPE = torch.Tensor.type


def set_profile(name: ProfileName) -> None:
    """Enforce the rules of ``name`` (``cuda`` or ``npu``, see ``profiles.py``) from now on in this
    process; the memory capacity becomes the profile's (or ``$MEGATRON_RL_EMULATED_MEMORY_GB``)."""
    if name not in PROFILES:
        raise ValueError(
            f"emulated profile {name!r}: expected one of {', '.join(PROFILES)} "
            "(MEGATRON_RL_PLATFORM=emulated selects cuda, emulated-npu selects npu)"
        )
    load()
    _apply(PROFILES[name])


def current_profile() -> str:
    """The active rule profile: ``cuda`` (the default) or ``npu``."""
    return str(_STATE.get("profile", "cuda"))


@contextlib.contextmanager
def profile(name: ProfileName) -> Iterator[None]:
    """Within the block, the rules of ``name``; the previous profile and capacity afterwards."""
    previous, capacity = current_profile(), memory_capacity()
    set_profile(name)
    try:
        yield
    finally:
        set_profile(previous)
        set_memory_capacity(capacity)


def set_memory_capacity(nbytes: int | None) -> None:
    """Device memory per emulated device in bytes (None: unlimited) until the next ``set_profile``."""
    if nbytes is not None and nbytes < 0:
        raise ValueError(f"emulated memory capacity {nbytes}: expected bytes >= 0, or None for unlimited")
    load().set_memory_capacity(-1 if nbytes is None else int(nbytes))


def memory_capacity() -> int | None:
    """Device memory per emulated device in bytes (None: unlimited)."""
    capacity = load().memory_capacity()
    return None if capacity < 0 else int(capacity)


def _profile_capacity(rules: Profile) -> int | None:
    """The profile's capacity unless ``$MEGATRON_RL_EMULATED_MEMORY_GB`` (GiB, 0 or less: unlimited) says."""
    text = os.environ.get(MEMORY_ENV, "").strip()
    if not text:
        return rules.memory.capacity_bytes
    try:
        gib = float(text)
    except ValueError:
        raise ValueError(f"{MEMORY_ENV}={text!r}: expected a number of GiB per device, e.g. 64") from None
    return int(gib * (1 << 30)) if gib > 0 else None


def _apply(rules: Profile) -> None:
    """Push one profile's rules into the extension's global flags and the Tensor.type patch."""
    import torch.distributed as dist

    ext, capacity = _STATE["ext"], _profile_capacity(rules)  # first: a bad value changes nothing
    compute, missing = rules.compute, rules.missing
    ext.set_compute_rules(
        rules.name, rules.device_name, list(compute.refused) if compute else [], compute.fix if compute else ""
    )
    reduce_ops = [int(getattr(dist.ReduceOp.RedOpType, op)) for op in (missing.reduce_ops if missing else ())]
    ext.set_collective_rules(
        [(list(r.collectives), list(r.accepted)) for r in rules.collective_dtypes],
        list(missing.collectives) if missing else [],
        reduce_ops,
        rules.contiguity.message if rules.contiguity else "",
    )
    ext.set_memory_capacity(-1 if capacity is None else capacity)
    _set_type_prefix(rules.type_string.prefix)
    _STATE["profile"] = rules.name


def _set_type_prefix(prefix: str) -> None:
    """``Tensor.type()`` of emulated tensors reads ``<prefix>.FloatTensor`` etc.: a patch of
    ``torch.Tensor.type`` while the prefix is not torch's own (left in place, inert, if another
    patch has wrapped it since)."""
    _STATE["type_prefix"] = prefix
    native = prefix == f"torch.{DEVICE_TYPE}"
    if not native and torch.Tensor.type is _ORIGINAL_TYPE:
        torch.Tensor.type = _profile_type
    elif native and torch.Tensor.type is _profile_type:
        torch.Tensor.type = _ORIGINAL_TYPE


def _profile_type(self: torch.Tensor, *args: object, **kwargs: object) -> str | torch.Tensor:
    """``Tensor.type`` with the active profile's type string for emulated tensors; casts unchanged."""
    result = _ORIGINAL_TYPE(self, *args, **kwargs)
    if not isinstance(result, str) or self.device.type != DEVICE_TYPE:  # a cast, or a host tensor
        return result
    return result.replace(f"torch.{DEVICE_TYPE}", str(_STATE["type_prefix"]), 1)


def _register_collectives(ext) -> None:
    import torch.distributed as dist

    if BACKEND.upper() in dist.Backend._plugins:
        return

    def create(store, rank: int, world_size: int, timeout: timedelta):
        inner = dist.ProcessGroupGloo(dist.PrefixStore(f"{BACKEND}-gloo/", store), rank, world_size, timeout)
        inner._set_sequence_number_for_group()
        return ext.CollectiveBackend(inner)

    dist.Backend.register_backend(BACKEND, create, devices=[DEVICE_TYPE])
