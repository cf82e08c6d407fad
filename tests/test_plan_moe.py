"""The plan's memory model on mixture-of-experts models (`plan/memory.py`, `plan/moe_memory.py`).

Reference: the parameters of the HF model itself (transformers, built on the meta device from
the tiny MoE configs of ``tests.hf_moe_models``), counted by name per pipeline stage: the
routed experts (``.experts.`` tensors) divided by EP × TP, the rest kept whole at TP 1.
"""

from __future__ import annotations

import pytest
import torch

from tests.hf_moe_models import tiny_moe_config

LAYERS = 4


def _hf_counts(family: str, pp: int, stage: int) -> tuple[int, int]:
    """(all, routed-expert) parameters of `stage`'s share of the HF model (at TP 1, EP 1)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_moe_config(family, layers=LAYERS, experts=4))
    per = LAYERS // pp
    mine = {f"model.layers.{i}." for i in range(stage * per, (stage + 1) * per)}
    total = experts = 0
    for name, p in model.named_parameters():
        in_stage = any(name.startswith(prefix) for prefix in mine)
        in_stage |= name.startswith("model.embed_tokens") and stage == 0
        in_stage |= name.startswith(("model.norm", "lm_head")) and stage == pp - 1
        if in_stage:
            total += p.numel()
            experts += p.numel() if ".experts." in name else 0
    return total, experts


def _settings(tp: int, pp: int, ep: int, dp: int = 4, distributed: bool = False):
    from megatron_rl.plan.memory import MemorySettings, MicroBatchShape

    shape = MicroBatchShape(tokens=512, prompt_len=128, response_len=128, responses=3, parts=1)
    return MemorySettings(
        tp=tp,
        pp=pp,
        dp=dp,
        ep=ep,
        dtype="bfloat16",
        copies=1,
        distributed_optimizer=distributed,
        attention_backend="flex",
        micro_batch=shape,
        make_vocab_size_divisible_by=1,
    )


def _dims(family: str):
    from megatron_rl.models.hf_config import decoder_spec_from_hf
    from megatron_rl.plan.memory import ModelDims

    return ModelDims.from_spec(decoder_spec_from_hf(tiny_moe_config(family, layers=LAYERS, experts=4).to_dict()))


@pytest.mark.parametrize(("family", "pp", "ep"), [("qwen3_moe", 2, 2), ("qwen2_moe", 1, 4), ("mixtral", 2, 1)])
def test_expert_params_per_rank_match_the_hf_model(family, pp, ep):
    from megatron_rl.plan.memory import estimate_memory

    dims = _dims(family)
    for stage in estimate_memory(dims, _settings(1, pp, ep)):
        hf_total, hf_experts = _hf_counts(family, pp, stage.stage)
        assert hf_experts > 0 and stage.expert_params == hf_experts // ep
        assert stage.params == hf_total - hf_experts + hf_experts // ep
    tp2 = estimate_memory(dims, _settings(2, pp, ep))  # expert TP = TP: each expert split in two
    assert [s.expert_params for s in tp2] == [_hf_counts(family, pp, s)[1] // (2 * ep) for s in range(pp)]


def test_expert_optimizer_state_is_sharded_over_expert_dp():
    from megatron_rl.plan.memory import estimate_memory

    (stage,) = estimate_memory(_dims("qwen2_moe"), _settings(1, 1, ep=2, dp=4, distributed=True))
    dense = stage.params - stage.expert_params
    # bf16: 12 B of Adam state per parameter; dense over dp = 4 ranks, experts over dp / ep = 2
    assert stage.optimizer == int(dense * 12 / 4 + stage.expert_params * 12 / 2)
    (whole,) = estimate_memory(_dims("qwen2_moe"), _settings(1, 1, ep=2, dp=4))
    assert whole.optimizer == whole.params * 12


def test_routed_tokens_scale_moe_activations_with_top_k():
    from dataclasses import replace

    from megatron_rl.plan.memory import layer_activation_bytes

    dims, s = _dims("mixtral"), _settings(1, 1, 1)
    k2 = layer_activation_bytes(dims, s, sparse=True)
    k4 = layer_activation_bytes(replace(dims, moe=replace(dims.moe, top_k=4)), s, sparse=True)
    T, h, f, b = s.micro_batch.tokens, dims.hidden, dims.moe.expert_ffn, 2
    # two more routed copies of every token: their input, output (h each), SwiGLU (5 f) and indices
    assert k4 - k2 == 2 * T * (2 * h * b + 5 * f * b + 8 + 12)
