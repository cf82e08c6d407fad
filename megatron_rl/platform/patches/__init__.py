"""Targeted patches that let megatron-core 0.16 run on a CPU-only torch build (gloo), on the CPU
or on the emulated accelerator (``eccl``).

Each patch lives in its own module with a header saying why, which versions, and when to
delete it. ``apply_cpu_patches`` applies them once; calling it again does nothing.
"""

from __future__ import annotations

import torch

_APPLIED = False


def apply_cpu_patches(device: torch.device | str = "cpu") -> None:
    """Apply every CPU adaptor patch to megatron-core (idempotent); ``device`` stands in for CUDA
    (``cpu``, or ``emulated:<local_rank>``)."""
    global _APPLIED
    from megatron_rl.platform.patches import cpu_rng, cpu_tensor_types, cpu_torch_proxy

    cpu_torch_proxy.set_target(torch.device(device))
    if _APPLIED:
        return
    cpu_torch_proxy.apply()
    cpu_rng.apply()
    cpu_tensor_types.apply()
    _APPLIED = True
