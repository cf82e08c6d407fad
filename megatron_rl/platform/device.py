"""Device and distributed-backend detection (cpu / cuda / npu / emulated -> gloo / nccl / hccl / eccl).

``MEGATRON_RL_PLATFORM`` (any of the names below) overrides the platform a command or a test
asks for, e.g. ``MEGATRON_RL_PLATFORM=emulated pytest ...`` runs CPU tests on the emulated
accelerator, where CUDA's device rules hold, and ``MEGATRON_RL_PLATFORM=emulated-npu`` on the same
device under an Ascend 910B's rules (see ``megatron_rl.platform.emulated``).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

import torch

DeviceType = Literal["cpu", "cuda", "npu", "emulated"]
PLATFORMS = ("auto", "cpu", "cuda", "npu", "emulated", "emulated-npu")
ENV_OVERRIDE = "MEGATRON_RL_PLATFORM"
_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl", "emulated": "eccl", "emulated-npu": "eccl"}
# The emulated device's rule profile per platform name (``megatron_rl.platform.emulated``).
_EMULATED_PROFILES: dict[str, str] = {"emulated": "cuda", "emulated-npu": "npu"}


@dataclass(frozen=True, kw_only=True)
class Platform:
    """Where this process computes and how it talks to its peers."""

    name: str  # as requested: cpu | cuda | npu | emulated | emulated-npu
    device_type: DeviceType
    dist_backend: str
    local_rank: int

    @property
    def npu_rules(self) -> bool:
        """True on an Ascend NPU and on the emulated device under the 910B profile: the platforms
        that take the NPU adaptor path (``platform/patches/npu.py``)."""
        return self.name in ("npu", "emulated-npu")

    @property
    def device(self) -> torch.device:
        """The torch device of this rank (``cpu`` or ``cuda:i`` / ``npu:i`` / ``emulated:i``)."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.local_rank)


def npu_available() -> bool:
    """True when torch_npu is installed and sees at least one Ascend device."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers the npu device with torch)

    return torch.npu.is_available()  # type: ignore[attr-defined]


def requested_platform(requested: str = "auto") -> str:
    """``requested``, unless ``$MEGATRON_RL_PLATFORM`` names another platform (it wins)."""
    override = os.environ.get(ENV_OVERRIDE, "").strip()
    if override:
        if override not in PLATFORMS:
            raise ValueError(f"{ENV_OVERRIDE}={override!r}: expected one of {', '.join(PLATFORMS)}")
        return override
    return requested


def detect_platform(requested: str = "auto") -> Platform:
    """Resolve ``requested`` (auto | cpu | cuda | npu | emulated | emulated-npu;
    ``$MEGATRON_RL_PLATFORM`` overrides it) to a ``Platform`` for this process."""
    if requested not in PLATFORMS:
        raise ValueError(f"platform {requested!r}: expected one of {', '.join(PLATFORMS)}")
    requested = requested_platform(requested)
    if requested == "auto":
        requested = "npu" if npu_available() else "cuda" if torch.cuda.is_available() else "cpu"
    elif requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("platform 'cuda' requested but torch sees no CUDA device")
    elif requested == "npu" and not npu_available():
        raise RuntimeError("platform 'npu' requested but torch_npu is not installed or sees no NPU")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_type = "emulated" if requested in _EMULATED_PROFILES else requested
    return Platform(name=requested, device_type=device_type, dist_backend=_BACKENDS[requested], local_rank=local_rank)


_APPLIED: dict[str, Platform] = {}


def current_platform() -> Platform | None:
    """The platform ``setup_platform`` set up in this process (None before it ran)."""
    return _APPLIED.get("platform")


def compute_device() -> torch.device:
    """This rank's compute device (``cpu`` until ``setup_platform`` ran)."""
    platform = current_platform()
    return platform.device if platform is not None else torch.device("cpu")


def setup_platform(requested: str = "auto") -> Platform:
    """Detect the platform, apply its megatron-core adaptors once, and pin this rank's device."""
    if "platform" in _APPLIED:
        platform = _APPLIED["platform"]
        requested = requested_platform(requested)
        if requested not in ("auto", platform.name):
            raise RuntimeError(f"platform already set up as {platform.name!r}, cannot switch to {requested!r}")
        return platform
    platform = detect_platform(requested)
    if platform.device_type == "emulated":
        from megatron_rl.platform import emulated

        emulated.load()
        emulated.set_profile(_EMULATED_PROFILES[platform.name])
        torch.emulated.set_device(platform.local_rank)  # type: ignore[attr-defined]
    if platform.npu_rules:
        from megatron_rl.platform.patches.npu import apply_npu_adaptor

        apply_npu_adaptor(platform.device, emulated=platform.device_type == "emulated")
    elif platform.device_type in ("cpu", "emulated"):
        from megatron_rl.platform.patches import apply_cpu_patches

        apply_cpu_patches(platform.device)
    else:
        torch.cuda.set_device(platform.local_rank)
    from megatron_rl.platform.patches import cross_entropy_sync, recompute_context

    recompute_context.apply()  # every platform: recompute must see the packed attention layout
    cross_entropy_sync.apply()  # every platform: no host sync in the vocab-parallel log-probs
    _APPLIED["platform"] = platform
    if os.environ.get("RANK", "0") == "0":
        print(
            f"megatron_rl: platform {platform.name} (device {platform.device}, collectives {platform.dist_backend})",
            flush=True,
        )
    return platform
