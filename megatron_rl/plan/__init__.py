"""Launch plan: ranks and engines per node, memory per device (``python -m megatron_rl plan``).

Where every rank and engine runs and how much device memory a training rank needs, before
anything launches.

Modules: `devices` (device memory table), `layout` (ranks and engines per node, megatron's
TP / CP / PP / DP coordinates), `memory` (the per-device memory model; its MoE and LoRA terms in
`moe_memory` and `lora_memory`, the attention core and context parallelism in `cp_memory`),
`model_engines` (the teacher's, judge's and reward model's engines:
placement and memory), `build` (config -> `Plan`, fit verdict, knob advice),
`report` (the printed text), `longest` (the longest answer that fits, per CP size).
"""

from .build import Plan, build_plan
from .devices import DEVICES, DeviceSpec, device_spec
from .layout import ClusterLayout, LayoutError, plan_layout
from .memory import MemorySettings, MicroBatchShape, ModelDims, StageMemory, estimate_memory
from .report import render

__all__ = [
    "DEVICES",
    "ClusterLayout",
    "DeviceSpec",
    "LayoutError",
    "MemorySettings",
    "MicroBatchShape",
    "ModelDims",
    "Plan",
    "StageMemory",
    "build_plan",
    "device_spec",
    "estimate_memory",
    "plan_layout",
    "render",
]
