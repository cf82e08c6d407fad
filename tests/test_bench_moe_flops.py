"""`bench` FLOPs of mixture-of-experts models count active parameters (`bench/flops.py`).

Reference: the HF model's own tensors (transformers, meta device, the tiny MoE configs of
``tests.hf_moe_models``): every matrix that multiplies activations (2-D, not the embedding),
with the routed experts' tensors weighted by top_k / num_experts (each token goes through k of
the E experts); and Qwen3-30B-A3B's published "3.3B activated" parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hf_moe_models import tiny_moe_config

REPO = Path(__file__).resolve().parents[1]


def _hf_active_matmul_params(config) -> float:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    k, e = config.num_experts_per_tok, getattr(config, "num_experts", None) or config.num_local_experts
    active = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name:
            continue
        active += p.numel() * (k / e if ".experts." in name else 1)
    return active


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_matmul_params_are_the_active_ones(family):
    from megatron_rl.bench.flops import GroupShape, matmul_params, training_flops
    from megatron_rl.models.hf_config import decoder_spec_from_hf

    config = tiny_moe_config(family, layers=4, experts=4)
    spec = decoder_spec_from_hf(config.to_dict())
    assert matmul_params(spec) == _hf_active_matmul_params(config)
    group = GroupShape(prompt_len=10, response_lens=(3, 5))
    pairs = 10 * 11 // 2 + sum(r * 10 + r * (r + 1) // 2 for r in (3, 5))
    hand = 3 * (2 * _hf_active_matmul_params(config) * 18 + 4 * 4 * 4 * 32 * pairs)
    assert training_flops(spec, [group]) == pytest.approx(hand, rel=1e-12)


def test_qwen3_30b_a3b_has_3_3b_active_params():
    from megatron_rl.bench.flops import matmul_params
    from megatron_rl.models.hf_config import decoder_spec_from_hf

    hf = json.loads((REPO / "examples/recipes/configs/qwen3-30b-a3b/config.json").read_text())
    active = matmul_params(decoder_spec_from_hf(hf)) + hf["hidden_size"] * hf["vocab_size"]  # + the embedding
    assert 3.3e9 < active < 3.4e9  # Qwen's model card: 30.5B total, 3.3B activated
