"""LoRA: low-rank adapters on megatron-core's tensor-parallel linears, sharded with TP and PP.

``apply_lora(model, settings, spec)`` adds ``y += scale * B(A(dropout(x)))`` (scale = alpha / rank,
PEFT's default) to the targeted ``linear_qkv`` / ``linear_proj`` / ``linear_fc1`` / ``linear_fc2`` of
a ``GPTModel`` built by ``megatron_rl.models`` and freezes every other parameter. Each fused megatron
linear holds one adapter per HF projection it fuses (``linear_qkv``: q, k, v; ``linear_fc1``: gate,
up), so the adapters are PEFT's, tensor for tensor (``peft_map`` converts both ways). ``switch``
turns them off for a forward (the reference: the frozen base) or swaps in a snapshot (the old policy).
"""

from __future__ import annotations

from megatron_rl.lora.adapter import LoraAdapter, LoraPart, merged_weight
from megatron_rl.lora.apply import apply_lora, lora_parameters
from megatron_rl.lora.peft_map import iter_peft_tensors, load_peft_tensors
from megatron_rl.lora.settings import LORA_TARGETS, LoraSettings
from megatron_rl.lora.switch import AdapterSnapshot, adapters_from, adapters_off, refresh_snapshot, snapshot_adapters

__all__ = [
    "LORA_TARGETS",
    "AdapterSnapshot",
    "LoraAdapter",
    "LoraPart",
    "LoraSettings",
    "adapters_from",
    "adapters_off",
    "apply_lora",
    "iter_peft_tensors",
    "load_peft_tensors",
    "lora_parameters",
    "merged_weight",
    "refresh_snapshot",
    "snapshot_adapters",
]
