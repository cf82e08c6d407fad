"""Unified tri-model: policy + old policy + reference in one TP/PP sharding on the same ranks.

One micro-step runs ONE pipeline schedule over packed micro-batches and yields, per
micro-batch, policy log-probs with grad and old / reference log-probs without
(``TriModel.run`` -> ``TriLogprobs``). ``plan_trimodel`` decides, with a stated reason,
whether old / ref are resident, offloaded to host memory between micro-steps, or skipped.
"""

from megatron_rl.trimodel.model import CopyMemory, TriModel, TriModelMemory, load_frozen_copies
from megatron_rl.trimodel.offload import HostOffload
from megatron_rl.trimodel.plan import CopyPlan, Residency, TriModelPlan, plan_trimodel
from megatron_rl.trimodel.stage import LogprobSettings, TriLogprobs, TriStage

__all__ = [
    "CopyMemory",
    "CopyPlan",
    "HostOffload",
    "LogprobSettings",
    "Residency",
    "TriLogprobs",
    "TriModel",
    "TriModelMemory",
    "TriModelPlan",
    "TriStage",
    "load_frozen_copies",
    "plan_trimodel",
]
