"""Tiny mixture-of-experts models for the routing-replay tests, built directly.

``megatron_moe``: a megatron-core ``GPTModel`` stage (local spec, shared-prompt attention)
whose layers are MoE except layer 2 (``moe_layer_freq=[1, 0, 1, 1]``), 4 experts, top 2, a
wide random router so top-k margins are clear. ``hf_moe``: a transformers Qwen3-MoE of the same
habits, for the ``hf`` engine (layer 1 dense: ``mlp_only_layers``).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, LAYERS, EXPERTS, TOP_K = 300, 4, 4, 2


def megatron_moe(seed: int = 0):
    """This rank's PP stage of a tiny MoE GPTModel (parallel state initialised), random weights."""
    import functools

    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.attention.core_attention import SharedPromptCoreAttention
    from megatron_rl.models.builder import _gpt_model_class
    from megatron_rl.platform import compute_device, to_device_
    from megatron_rl.platform.patches import moe_off_cuda

    moe_off_cuda.apply()

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
        kv_channels=32, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, variable_seq_lengths=True,
        num_moe_experts=EXPERTS, moe_router_topk=TOP_K, moe_ffn_hidden_size=32, moe_layer_freq=[1, 0, 1, 1],
        moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
    )
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = functools.partial(
            SharedPromptCoreAttention, backend="reference")
    torch.manual_seed(seed)
    model = _gpt_model_class()(
        config=config, transformer_layer_spec=block, vocab_size=VOCAB, max_sequence_length=256,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False, position_embedding_type="rope",
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(0.0, 0.5)
    return to_device_(model, compute_device())


def hf_moe(path: Path, *, seed: int = 0) -> Path:
    """Write a tiny random Qwen3-MoE checkpoint (4 layers, layer 1 dense, 4 experts, top 2)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
        max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=VOCAB - 1, bos_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name.endswith("mlp.gate.weight") else 0.05
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    model.save_pretrained(path)
    return path
