"""Megatron-core GPT models built from HF configs, and HF <-> megatron weight conversion."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.models.builder import build_gpt_model
from megatron_rl.models.hf_config import DecoderSpec, check_parallel_fit, decoder_spec_from_hf, read_hf_config
from megatron_rl.models.hf_io import HFCheckpointReader, export_hf_tensors, load_hf_weights, save_hf_checkpoint

__all__ = [
    "DecoderSpec",
    "HFCheckpointReader",
    "build_gpt_model",
    "decoder_spec_from_hf",
    "export_hf_tensors",
    "load_hf_weights",
    "load_model_from_hf",
    "read_hf_config",
    "save_hf_checkpoint",
]


def load_model_from_hf(
    hf_path: str | Path,
    *,
    params_dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    attention_backend: str | None = None,
    megatron_overrides: dict | None = None,
    moe_losses: dict | None = None,
) -> tuple[torch.nn.Module, DecoderSpec]:
    """Build this rank's TP/PP shard of the model at ``hf_path`` and load its weights.

    The parallel state must be initialised (``megatron_rl.parallel.state.initialize_parallel``).
    """
    from megatron.core import parallel_state

    spec = decoder_spec_from_hf(read_hf_config(hf_path))
    check_parallel_fit(
        spec,
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
    )
    model = build_gpt_model(
        spec,
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        params_dtype=params_dtype,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        attention_backend=attention_backend,
        megatron_overrides=megatron_overrides,
        moe_losses=moe_losses,
    )
    load_hf_weights(model, hf_path, spec)
    return model, spec
