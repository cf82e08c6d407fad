"""Build a megatron-core ``GPTModel`` (local, non-Transformer-Engine spec) from a ``DecoderSpec``.

The model describes the network only: the sharding comes from the parallel state that
``megatron_rl.parallel`` initialised before this is called (STYLE: models know nothing of
parallelism beyond what megatron-core reads from its config).
"""

from __future__ import annotations

import torch

from megatron_rl.models.hf_config import DecoderSpec, padded_vocab_size, transformer_config_from_spec


def gpt_layer_spec(spec: DecoderSpec, core_attention: type | None = None):
    """The local-spec transformer layer for ``spec``; ``core_attention`` replaces the attention kernel."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer = get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    if core_attention is not None:
        layer.submodules.self_attention.submodules.core_attention = core_attention
    return layer


def build_gpt_model(
    spec: DecoderSpec,
    *,
    tp: int,
    pp: int,
    params_dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    core_attention: type | None = None,
    megatron_overrides: dict | None = None,
):
    """One model replica's stage of ``GPTModel`` for the current PP rank (parallel state must be set up)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config_from_spec(spec, tp=tp, pp=pp, params_dtype=params_dtype, overrides=megatron_overrides)
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(spec, core_attention),
        vocab_size=padded_vocab_size(spec.vocab_size, make_vocab_size_divisible_by, tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
    )
    return model.to(params_dtype)
