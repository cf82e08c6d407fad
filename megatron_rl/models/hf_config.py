"""Translate a Hugging Face causal-LM config into a megatron-core ``TransformerConfig``.

Supported families: Llama, Qwen2 / Qwen2.5 (qkv bias), Qwen3 (per-head q/k RMSNorm), and the
mixture-of-experts Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral (``models.moe``). All are
pre-norm RMSNorm decoders with SwiGLU MLPs and rotary embeddings; GQA and tied or untied
embeddings are read from the config. Anything else (rope scaling variants, sliding window) is
refused with an error naming the config field, never silently approximated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl.config.fields import raise_found
from megatron_rl.config.model_shape import check_megatron_passthrough, parallel_fit  # parallel_fit: re-exported
from megatron_rl.models.moe import MOE_MODEL_TYPES, MoeSpec, moe_spec_from_hf, moe_transformer_kwargs

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", *MOE_MODEL_TYPES)


@dataclass(frozen=True, kw_only=True)
class DecoderSpec:
    """The architecture facts megatron_rl needs from a HF config, family-independent."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    moe: MoeSpec | None = None  # None: a dense decoder


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Load ``config.json`` from a HF checkpoint directory (or the file itself) as a dict."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no HF config at {file} (expected a checkpoint directory with config.json)")
    with open(file) as f:
        return json.load(f)


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    # transformers 5 moves rope settings into `rope_parameters`; 4.x kept `rope_theta` flat.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(f"HF config rope type {rope_type!r} is not supported (only plain RoPE)")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ValueError("HF config has no rope_theta (neither `rope_theta` nor `rope_parameters.rope_theta`)")
    return float(theta)


def decoder_spec_from_hf(cfg: Mapping[str, Any]) -> DecoderSpec:
    """Extract a ``DecoderSpec`` from a HF config dict; raise ``ValueError`` for unsupported ones."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"HF config model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"HF config hidden_act {cfg['hidden_act']!r} is not supported (only silu / SwiGLU)")
    if cfg.get("use_sliding_window"):
        raise ValueError("HF config use_sliding_window=true is not supported")
    heads = cfg["num_attention_heads"]
    if model_type == "llama" and cfg.get("mlp_bias"):
        raise ValueError("HF config mlp_bias=true is not supported")
    return DecoderSpec(
        model_type=model_type,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg),
        qkv_bias=model_type == "qwen2"
        or bool(cfg.get("qkv_bias" if model_type == "qwen2_moe" else "attention_bias", model_type == "qwen2_moe")),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        moe=moe_spec_from_hf(cfg) if model_type in MOE_MODEL_TYPES else None,
    )


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def _fixed_kwargs() -> dict[str, Any]:
    """The ``TransformerConfig`` fields every supported decoder shares (no dropout, no fused
    kernels: the local, non-TE spec on any device)."""
    return dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        sequence_parallel=False,  # the local (non-TE) spec's torch norms do not support SP
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        variable_seq_lengths=True,  # packed micro-batches differ in length (PP p2p sends shapes)
        moe_token_dispatcher_type="alltoall",  # dense model; 0.16 rejects variable lengths with the default
        cuda_graph_scope=[],  # the default "full" is deprecated in 0.16 and warns on every config
    )


def transformer_config_from_spec(
    spec: DecoderSpec,
    *,
    tp: int,
    pp: int,
    params_dtype: torch.dtype = torch.float32,
    overrides: Mapping[str, Any] | None = None,
    moe_losses: Mapping[str, Any] | None = None,
    ep: int = 1,
):
    """Build the megatron-core ``TransformerConfig`` for ``spec`` at the given TP/PP/EP sizes
    (``moe_losses``: the router-loss fields of ``models.moe.moe_loss_kwargs``, MoE models only).
    ``ep`` must be the parallel state's: megatron's expert linears mark their weights as
    expert-parallel (reduced over the expert-DP group, not DP) only when the config says EP > 1."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim,
        layernorm_epsilon=spec.rms_norm_eps,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        **_fixed_kwargs(),
    )
    if spec.moe is not None:
        kwargs.update(moe_transformer_kwargs(spec.moe), **(moe_losses or {}))
    raise_found(check_megatron_passthrough(overrides or {}))  # the config's model.megatron rule
    kwargs.update(overrides or {})
    return TransformerConfig(**kwargs)


def check_parallel_fit(spec: DecoderSpec, tp: int, pp: int, ep: int = 1) -> None:
    """Raise ``ValueError`` naming the sizes when TP/PP/EP cannot shard the model of ``spec``."""
    sizes = {
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "intermediate_size": spec.ffn_hidden_size,
    }
    if spec.moe is not None:  # the experts' tensor-parallel size is TP
        sizes["moe_intermediate_size"] = spec.moe.expert_ffn_hidden_size
    problems = [
        f"{key} {msg}"
        for key, msg in zip(("tp", "pp"), parallel_fit(sizes, spec.num_layers, tp, pp), strict=True)
        if msg
    ]
    if ep > 1 and spec.moe is None:
        problems.append(f"ep {ep} needs a mixture-of-experts model ({spec.model_type!r} is dense: use ep 1)")
    elif spec.moe is not None and spec.moe.num_experts % ep:
        problems.append(f"ep {ep} does not divide num_experts ({spec.moe.num_experts})")
    if problems:
        raise ValueError("; ".join(problems))
