"""Ascend adaptor: torch_npu (registers the ``npu`` device; its ``transfer_to_npu`` maps
``torch.cuda.*``, ``.cuda()`` and ``device="cuda"`` to the NPU), the megatron-core patches every
non-CUDA device needs (``apply_megatron_patches``: type names, tied embeddings), and, when
installed, MindSpeed's megatron adaptor (NPU fused kernels).

Why: megatron-core targets CUDA; on Ascend the vendor-maintained adaptors do what the ``cpu_*``
patches do for the CPU, except ``Tensor.type()``: torch_npu leaves ``'torch.npu.FloatTensor'``,
which megatron's optimizer build and grad clipping refuse (``megatron_tensor_types``).

The emulated device under its 910B profile (``MEGATRON_RL_PLATFORM=emulated-npu``) takes this path
too, with the CPU shims standing in for torch_npu's ``transfer_to_npu`` (torch_npu cannot be
imported without CANN). Versions: torch_npu matching the installed torch (the ``npu`` extra pins
it); MindSpeed is optional.
"""

from __future__ import annotations

import importlib.util

import torch

from megatron_rl.platform.patches import apply_megatron_patches, redirect_cuda_calls


def apply_npu_adaptor(device: torch.device, *, emulated: bool = False) -> None:
    """Import torch_npu and its ``transfer_to_npu`` (required on a real NPU; on the emulated device
    the CPU redirects stand in), patch megatron-core for ``device`` (the same patches on both), and
    on a real NPU pin this rank's device and load MindSpeed's megatron adaptor when installed."""
    if emulated:
        redirect_cuda_calls(device)  # what transfer_to_npu does on a real NPU
    else:
        _import_torch_npu()
    apply_megatron_patches(device)
    if emulated:
        return
    torch.npu.set_device(device)  # type: ignore[attr-defined]
    if importlib.util.find_spec("mindspeed") is not None:
        import mindspeed.megatron_adaptor  # noqa: F401


def _import_torch_npu() -> None:
    if importlib.util.find_spec("torch_npu") is None:
        raise RuntimeError(
            "platform 'npu' needs torch_npu (and CANN): pip install 'megatron_rl[npu]' "
            "on a machine with the Ascend toolkit (source its set_env.sh first)"
        )
    import torch_npu  # noqa: F401
    from torch_npu.contrib import transfer_to_npu  # noqa: F401  (maps torch.cuda.* calls to npu)
