"""Device and distributed-backend detection (cpu / cuda / npu -> gloo / nccl / hccl)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

import torch

DeviceType = Literal["cpu", "cuda", "npu"]
_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True, kw_only=True)
class Platform:
    """Where this process computes and how it talks to its peers."""

    device_type: DeviceType
    dist_backend: str
    local_rank: int

    @property
    def device(self) -> torch.device:
        """The torch device of this rank (``cpu`` or ``cuda:i`` / ``npu:i``)."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.local_rank)


def npu_available() -> bool:
    """True when torch_npu is installed and sees at least one Ascend device."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers the npu device with torch)

    return torch.npu.is_available()  # type: ignore[attr-defined]


def detect_platform(requested: str = "auto") -> Platform:
    """Resolve ``requested`` (auto | cpu | cuda | npu) to a ``Platform`` for this process."""
    if requested not in ("auto", "cpu", "cuda", "npu"):
        raise ValueError(f"platform {requested!r}: expected one of auto, cpu, cuda, npu")
    if requested == "auto":
        requested = "npu" if npu_available() else "cuda" if torch.cuda.is_available() else "cpu"
    elif requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("platform 'cuda' requested but torch sees no CUDA device")
    elif requested == "npu" and not npu_available():
        raise RuntimeError("platform 'npu' requested but torch_npu is not installed or sees no NPU")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return Platform(device_type=requested, dist_backend=_BACKENDS[requested], local_rank=local_rank)


_APPLIED: dict[str, Platform] = {}


def setup_platform(requested: str = "auto") -> Platform:
    """Detect the platform, apply its megatron-core adaptors once, and pin this rank's device."""
    if "platform" in _APPLIED:
        platform = _APPLIED["platform"]
        if requested not in ("auto", platform.device_type):
            raise RuntimeError(f"platform already set up as {platform.device_type!r}, cannot switch to {requested!r}")
        return platform
    platform = detect_platform(requested)
    if platform.device_type == "cpu":
        from megatron_rl.platform.patches import apply_cpu_patches

        apply_cpu_patches()
    elif platform.device_type == "npu":
        from megatron_rl.platform.patches.npu import apply_npu_adaptor

        apply_npu_adaptor()
        torch.npu.set_device(platform.local_rank)  # type: ignore[attr-defined]
    else:
        torch.cuda.set_device(platform.local_rank)
    _APPLIED["platform"] = platform
    return platform
