"""Mixture-of-experts facts of a HF config, and the megatron-core settings that reproduce them.

Families: Qwen3-MoE (``qwen3_moe``), Qwen2-MoE (``qwen2_moe``: a shared expert behind a
sigmoid gate) and Mixtral (``mixtral``). All route with a softmax over the router logits and
take the top k; ``norm_topk_prob`` renormalises the k weights (Mixtral always does). In
megatron-core that is ``moe_router_pre_softmax=False`` (top k of the logits, softmax over those
k: the same weights) when renormalised, ``moe_router_pre_softmax=True`` (softmax over every
expert, then top k, no renormalisation) when not.

Which layers are sparse follows transformers: layer ``i`` is MoE unless ``i`` is in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; the others keep a dense MLP of
``intermediate_size`` (megatron's ``moe_layer_freq`` as a per-layer list).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")

# HF tensor names of the MoE block per family: router, per-expert (gate, up, down), shared expert.
_HF_NAMES = {
    "qwen3_moe": (
        "mlp.gate.weight",
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    ),
    "qwen2_moe": (
        "mlp.gate.weight",
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    ),
    "mixtral": (
        "block_sparse_moe.gate.weight",
        (
            "block_sparse_moe.experts.{e}.w1.weight",
            "block_sparse_moe.experts.{e}.w3.weight",
            "block_sparse_moe.experts.{e}.w2.weight",
        ),
    ),
}


@dataclass(frozen=True, kw_only=True)
class MoeSpec:
    """The expert layout of a MoE decoder, family-independent."""

    num_experts: int
    top_k: int
    expert_ffn_hidden_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)
    shared_expert_ffn_hidden_size: int | None = None  # Qwen2-MoE's shared expert
    shared_expert_gate: bool = False
    router_aux_loss_coef: float = 0.0  # the checkpoint's own coefficient (informative only)
    router_hf_name: str = "mlp.gate.weight"
    expert_hf_names: tuple[str, str, str] = _HF_NAMES["qwen3_moe"][1]


def _sparse_layers(cfg: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def moe_spec_from_hf(cfg: Mapping[str, Any]) -> MoeSpec:
    """The ``MoeSpec`` of a MoE HF config (``model_type`` in ``MOE_MODEL_TYPES``)."""
    model_type = cfg["model_type"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        raise ValueError(f"HF config of {model_type!r} has no num_experts / num_local_experts")
    if float(cfg.get("router_jitter_noise", 0.0) or 0.0):
        raise ValueError("HF config router_jitter_noise != 0 is not supported (training-time noise)")
    router, expert_names = _HF_NAMES[model_type]
    shared = cfg.get("shared_expert_intermediate_size") if model_type == "qwen2_moe" else None
    return MoeSpec(
        num_experts=int(experts),
        top_k=int(cfg["num_experts_per_tok"]),
        expert_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        norm_topk_prob=True if model_type == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=_sparse_layers(cfg, cfg["num_hidden_layers"])
        if model_type != "mixtral"
        else (True,) * cfg["num_hidden_layers"],
        shared_expert_ffn_hidden_size=int(shared) if shared else None,
        shared_expert_gate=bool(shared),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0) or 0.0),
        router_hf_name=router,
        expert_hf_names=expert_names,
    )


def moe_transformer_kwargs(moe: MoeSpec) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` fields that route and compute as the HF model does.
    No auxiliary loss here: the run's ``model.moe`` settings add it (``moe_loss_kwargs``)."""
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_layer_freq=[int(s) for s in moe.sparse_layers],
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_grouped_gemm=False,  # SequentialMLP: one local MLP per expert (any device, no TE)
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def moe_loss_kwargs(load_balancing: str, aux_loss_coeff: float, z_loss_coeff: float) -> dict[str, Any]:
    """megatron-core fields for the router's auxiliary losses (``model.moe`` of the run config):
    ``load_balancing`` is aux_loss | seq_aux_loss | none; a z-loss of 0 is off."""
    return dict(
        moe_router_load_balancing_type=load_balancing if aux_loss_coeff else "none",
        moe_aux_loss_coeff=aux_loss_coeff if load_balancing != "none" else 0.0,
        moe_z_loss_coeff=z_loss_coeff or None,
    )
