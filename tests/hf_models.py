"""Tiny random HF checkpoints (Llama, Qwen2, Qwen3) for parity tests, written as safetensors.

Every parameter, norms and biases included, is randomised so a wrong mapping cannot hide
behind ones or zeros. head_dim is 32 (vLLM's minimum) and the vocabulary (300) is not a
multiple of megatron's padding so padded logits are exercised.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3")


def tiny_config(family: str, *, tied: bool = False, layers: int = 4):
    """A small HF config of ``family`` (GQA: 4 query heads, 2 KV heads, head_dim 32)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        rope_theta=10000.0,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(head_dim=32, **common)
    raise ValueError(family)


def make_tiny_hf(path: Path, family: str, *, tied: bool = False, seed: int = 0, layers: int = 4) -> Path:
    """Write a randomly initialised tiny ``family`` checkpoint to ``path``; return ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tied=tied, layers=layers), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def hf_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Reference fp32 logits from transformers for ``input_ids [b, s]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(input_ids).logits.float()
