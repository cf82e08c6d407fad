"""Accelerator memory table for `python -m megatron_rl plan` (`--device`).

Each entry is the device memory one training rank may use and a dense bf16 peak (for the
compute lower bound the plan prints). A layout fits when its per-device estimate is at most
``usable_fraction`` of the capacity: the rest is left to what the estimate does not count
(CUDA / CANN context, NCCL / HCCL buffers, allocator fragmentation, megatron's workspace).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One device kind: its memory and what share of it the plan lets a training rank fill."""

    name: str  # the --device value
    kind: str  # torch device type of its ranks: npu | cuda | cpu
    memory_bytes: int  # device memory (HBM; machine RAM for cpu)
    peak_tflops: float | None  # dense bf16 peak; None = unknown (cpu: pass --peak-tflops)
    usable_fraction: float = 0.90  # share of memory_bytes the estimate may fill

    @property
    def usable_bytes(self) -> int:
        """Bytes the plan lets one device's estimate reach."""
        return int(self.memory_bytes * self.usable_fraction)


def _machine_ram() -> int:
    """Physical RAM of this machine (the `cpu` device's memory)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# Vendor figures: Ascend 910B 64 GB HBM2e; A100 / H100 SXM 80 GB; H200 141 GB HBM3e.
DEVICES: dict[str, DeviceSpec] = {
    "910b": DeviceSpec(name="910b", kind="npu", memory_bytes=64 * GIB, peak_tflops=313.0),
    "h100": DeviceSpec(name="h100", kind="cuda", memory_bytes=80 * GIB, peak_tflops=989.0),
    "h200": DeviceSpec(name="h200", kind="cuda", memory_bytes=141 * 10**9, peak_tflops=989.0),
    "a100": DeviceSpec(name="a100", kind="cuda", memory_bytes=80 * GIB, peak_tflops=312.0),
}


def device_spec(name: str) -> DeviceSpec:
    """The table entry for ``--device name`` (``cpu``: this machine's RAM)."""
    if name == "cpu":
        return DeviceSpec(name="cpu", kind="cpu", memory_bytes=_machine_ram(), peak_tflops=None)
    if name not in DEVICES:
        raise ValueError(f"--device {name!r} is not one of {', '.join([*DEVICES, 'cpu'])}")
    return DEVICES[name]
