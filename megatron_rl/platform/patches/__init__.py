"""Targeted patches that let megatron-core 0.16 run on a CPU-only torch build (gloo).

Each patch lives in its own module with a header saying why, which versions, and when to
delete it. ``apply_cpu_patches`` applies them once; calling it again does nothing.
"""

from __future__ import annotations

_APPLIED = False


def apply_cpu_patches() -> None:
    """Apply every CPU adaptor patch to megatron-core (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    from megatron_rl.platform.patches import cpu_rng, cpu_tensor_types, cpu_torch_proxy

    cpu_torch_proxy.apply()
    cpu_rng.apply()
    cpu_tensor_types.apply()
    _APPLIED = True
