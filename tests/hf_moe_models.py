"""Tiny random HF mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral) for parity tests.

Same habits as ``tests.hf_models``: every tensor random (norms around 1), head_dim 32, a
vocabulary of 300. 4 experts, top 2, layer 1 of Qwen3-MoE dense (``mlp_only_layers``) so the
mixed dense / MoE stack is exercised. The router gets a wide init (std 0.5) so the top-k
choice has clear margins: fp32 summation-order noise then never flips an expert.
"""

from __future__ import annotations

from pathlib import Path

import torch

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


def tiny_moe_config(family: str, *, layers: int = 4, experts: int = 4):
    """A small HF MoE config of ``family`` (GQA: 4 query heads, 2 KV heads, head_dim 32)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=300,
        hidden_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        num_experts_per_tok=2,
    )
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=64,
            num_experts=experts,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            decoder_sparse_step=1,
            **common,
        )
    if family == "qwen2_moe":
        return Qwen2MoeConfig(
            intermediate_size=96,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=96,
            num_experts=experts,
            norm_topk_prob=False,
            **common,
        )
    if family == "mixtral":
        return MixtralConfig(head_dim=32, intermediate_size=64, num_local_experts=experts, **common)
    raise ValueError(family)


def make_tiny_moe(path: Path, family: str = "qwen3_moe", *, seed: int = 0, layers: int = 4, experts: int = 4) -> Path:
    """Write a randomly initialised tiny MoE checkpoint of ``family`` to ``path``; return ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_moe_config(family, layers=layers, experts=experts), dtype=torch.float32
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("gate.weight") and "shared" not in name:  # the router
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return path
