"""The ``lora`` section: low-rank adapters on the policy (``megatron_rl.lora``), off by default."""

from __future__ import annotations

from dataclasses import dataclass, field

# megatron-core's linear names a LoRA target may name (a GPTModel's attention and MLP linears).
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA on the policy: a frozen base (no gradient, no optimizer state, no fp32 master) and
    trainable adapters; the reference is the base (adapters off), the old policy an adapter snapshot."""

    rank: int = 0  # adapter rank r; 0 = full fine-tuning (no adapters)
    alpha: float = 16.0  # scale = alpha / rank (PEFT's lora_alpha, not rsLoRA)
    dropout: float = 0.0  # dropout on the adapter's input (PEFT's lora_dropout)
    # megatron linears adapted, by name: attention linear_qkv / linear_proj, MLP linear_fc1 / linear_fc2
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    seed: int = 0  # seed of the adapters' A initialisation (the same full A at every TP / PP layout)
    save_merged: bool = False  # also write a merged HF checkpoint (W + scale * B A) beside the adapters at each save
