"""Ascend adaptor: torch_npu (registers the ``npu`` device and ``torch.cuda`` shims for it) and,
when installed, MindSpeed's megatron adaptor (NPU fused kernels and megatron-core patches).

Why: megatron-core targets CUDA; on Ascend the vendor-maintained adaptors do what
``cpu_*`` patches do for CPU. Versions: whatever torch_npu matches the installed torch;
MindSpeed is optional. Nothing here runs on machines without torch_npu.
"""

from __future__ import annotations

import importlib.util


def apply_npu_adaptor() -> None:
    """Import torch_npu (required) and MindSpeed's megatron adaptor (optional)."""
    if importlib.util.find_spec("torch_npu") is None:
        raise RuntimeError("platform 'npu' needs torch_npu: pip install 'megatron_rl[npu]'")
    import torch_npu  # noqa: F401
    from torch_npu.contrib import transfer_to_npu  # noqa: F401  (maps torch.cuda.* calls to npu)

    if importlib.util.find_spec("mindspeed") is not None:
        import mindspeed.megatron_adaptor  # noqa: F401
