"""Targeted patches that let megatron-core 0.16 run where it was not written for: on a CPU-only
torch build (gloo), on the emulated accelerator (``eccl``) and on Ascend NPUs.

Each patch lives in its own module with a header saying why, which versions, and when to
delete it. ``apply_cpu_patches`` applies the CPU shims once; ``apply_megatron_patches`` the
patches every non-CUDA device needs (``npu.apply_npu_adaptor`` calls it on NPUs); calling either
again does nothing but retarget.
"""

from __future__ import annotations

import torch

_APPLIED = False


def apply_megatron_patches(device: torch.device | str) -> None:
    """Patches of megatron-core every non-CUDA device needs, real NPUs included: CUDA tensor-type
    names and ``.cuda()`` -> ``device`` inside the functions that test them."""
    from megatron_rl.platform.patches import megatron_tensor_types

    megatron_tensor_types.apply(torch.device(device))


def redirect_cuda_calls(device: torch.device | str) -> None:
    """Run megatron-core's ``torch.cuda.*`` calls and ``device="cuda"`` factories on ``device``
    (``cpu`` or ``emulated:<local_rank>``) and keep its model-parallel RNG states on the host
    generator (idempotent; a second call retargets). On an NPU torch_npu's ``transfer_to_npu``
    does this."""
    global _APPLIED
    from megatron_rl.platform.patches import cpu_rng, cpu_torch_proxy

    cpu_torch_proxy.set_target(torch.device(device))
    if _APPLIED:
        return
    cpu_torch_proxy.apply()
    cpu_rng.apply()
    _APPLIED = True


def apply_cpu_patches(device: torch.device | str = "cpu") -> None:
    """Every patch megatron-core needs on ``device`` (``cpu``, or ``emulated:<local_rank>`` under
    CUDA's rules): the CUDA-call redirects and the megatron patches (idempotent)."""
    redirect_cuda_calls(device)
    apply_megatron_patches(device)
