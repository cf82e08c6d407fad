"""Move a built model to its compute device the way ``module.to("cuda")`` does from the CPU.

Between CPU and CUDA, ``module.to(device)`` keeps every ``Parameter`` object (it assigns
``param.data``), so attributes megatron-core sets on parameters survive (``tensor_model_parallel``,
``partition_dim``, ``shared``, ``allreduce``, ...: grad clipping, DDP buckets and tied
embeddings read them). Between the CPU and a PrivateUse1 device (the emulated device, an NPU)
torch refuses ``param.data = device_tensor`` and ``module.to`` makes new ``Parameter`` objects
without those attributes. ``to_device_`` moves each parameter in place (``swap_tensors``) and
keeps its attributes, on every device.
"""

from __future__ import annotations

import torch


def to_device_(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """Move ``module``'s parameters (same objects, same attributes) and buffers to ``device``."""
    device = torch.device(device)
    for sub in module.modules():
        for param in sub._parameters.values():
            if param is None or param.device == device:  # shared parameters move once
                continue
            attributes = dict(param.__dict__)
            moved = torch.nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, moved)
            param.__dict__.update(attributes)
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.device != device:
                sub._buffers[name] = buffer.to(device)
    return module
