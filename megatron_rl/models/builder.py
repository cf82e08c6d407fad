"""Build a megatron-core ``GPTModel`` (local, non-Transformer-Engine spec) from a ``DecoderSpec``.

The model describes the network only: the sharding comes from the parallel state that
``megatron_rl.parallel`` initialised before this is called (STYLE: models know nothing of
parallelism beyond what megatron-core reads from its config).
"""

from __future__ import annotations

import functools

import torch

from megatron_rl.models.hf_config import DecoderSpec, padded_vocab_size, transformer_config_from_spec
from megatron_rl.models.positions import PositionIndexedRotary


def gpt_layer_spec(spec: DecoderSpec, attention_backend: str | None = None, *, sparse: bool = False):
    """The local-spec transformer layer for ``spec`` (``sparse``: its MLP is the MoE block).

    ``attention_backend`` (auto | reference | split | flex | triton | npu) swaps megatron's
    ``DotProductAttention`` for shared-prompt attention; None keeps megatron's own.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    experts = spec.moe.num_experts if sparse and spec.moe is not None else None
    layer = get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=spec.qk_norm, normalization="RMSNorm"
    )
    if attention_backend is not None:
        from megatron_rl.attention.core_attention import SharedPromptCoreAttention

        layer.submodules.self_attention.submodules.core_attention = functools.partial(
            SharedPromptCoreAttention, backend=attention_backend
        )
    return layer


def decoder_block_spec(spec: DecoderSpec, config, attention_backend: str | None = None):
    """This PP stage's layer specs: one spec for every layer of a dense model; for a MoE model
    each layer's own (MoE or dense MLP, ``MoeSpec.sparse_layers``), cut to the stage's layers."""
    if spec.moe is None:
        return gpt_layer_spec(spec, attention_backend)
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_rl.platform.patches import moe_cp_router_losses, moe_off_cuda

    moe_off_cuda.apply()
    moe_cp_router_losses.apply()  # router losses of a CP rank's uneven slice (acts at cp > 1 only)
    layers = [gpt_layer_spec(spec, attention_backend, sparse=s) for s in spec.moe.sparse_layers]
    offset, count = get_transformer_layer_offset(config), get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=layers[offset : offset + count], layer_norm=LayerNormImpl)


@functools.cache
def _gpt_model_class():
    """``GPTModel`` whose RoPE follows the position ids given to ``forward`` (packed groups need it)."""
    from megatron.core.models.gpt import GPTModel

    class PositionalGPTModel(GPTModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.rotary_pos_emb = PositionIndexedRotary(self.rotary_pos_emb)

        def forward(self, input_ids, position_ids, attention_mask=None, **kwargs):
            self.rotary_pos_emb.position_ids = position_ids
            try:
                return super().forward(input_ids, position_ids, attention_mask, **kwargs)
            finally:
                self.rotary_pos_emb.position_ids = None

    return PositionalGPTModel


def build_gpt_model(
    spec: DecoderSpec,
    *,
    tp: int,
    pp: int,
    params_dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    attention_backend: str | None = None,
    megatron_overrides: dict | None = None,
    moe_losses: dict | None = None,
):
    """This rank's PP stage of the model (parallel state must be set up) on this rank's compute
    device; weights are random (initialised on the CPU, as ``use_cpu_initialization`` asks)."""
    from megatron.core import parallel_state

    from megatron_rl.platform import compute_device, to_device_

    config = transformer_config_from_spec(
        spec,
        tp=tp,
        pp=pp,
        params_dtype=params_dtype,
        overrides=megatron_overrides,
        moe_losses=moe_losses,
        ep=parallel_state.get_expert_model_parallel_world_size(),
    )
    # megatron's CP size (its schedules scale the loss by it, its DDP reduces over DP x CP); the
    # attention under CP is ours (attention.context_parallel), not megatron's ring attention
    config.context_parallel_size = parallel_state.get_context_parallel_world_size()
    model = _gpt_model_class()(
        config=config,
        transformer_layer_spec=decoder_block_spec(spec, config, attention_backend),
        vocab_size=padded_vocab_size(spec.vocab_size, make_vocab_size_divisible_by, tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
    )
    return to_device_(model.to(params_dtype), compute_device())
