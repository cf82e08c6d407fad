"""Platform: the compute device and collective backend per rank; adaptors (CPU, emulated, torch_npu).

Which device this rank computes on, which collective backend it uses, and the adaptors that let
megatron-core run there (CPU shims here; torch_npu / MindSpeed on Ascend).

Call ``setup_platform()`` once per process before building models; it is idempotent.
"""

from megatron_rl.platform.device import Platform, compute_device, current_platform, detect_platform, setup_platform
from megatron_rl.platform.placement import to_device_

__all__ = ["Platform", "compute_device", "current_platform", "detect_platform", "setup_platform", "to_device_"]
