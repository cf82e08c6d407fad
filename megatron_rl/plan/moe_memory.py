"""The mixture-of-experts terms of the plan's memory model (`plan/memory.py`).

Parameters of a sparse layer on one rank (TP size t, expert-parallel size e; megatron's expert
tensor-parallel size defaults to t, which megatron_rl keeps):

    router            E·h                 replicated (megatron's TopKRouter is not TP-sharded)
    routed experts    (E / e)·3·h·f_e / t  each rank holds E / e experts, each TP-sharded
    shared expert     3·h·f_s / t (+ h for its sigmoid gate)

They replace the dense MLP's 3·h·f / t. Expert parameters are reduced (and, with the distributed
optimizer, their Adam state sharded) over the expert-data-parallel group: dp·t / (e·t) = dp / e
ranks, where the dense parameters use dp.

Activations of a sparse layer for T tokens, top k: with balanced routing each EP rank receives
as many routed copies as it sends, T·k, so the routed part is sized on T·k tokens (an imbalanced
router puts more on some ranks: not modelled). Saved for the backward:

    router            T·E·(b + 4) + 12·T·k    logits, fp32 scores, top-k probs and indices
    permuted input    T·k·h·b + 8·T·k         fc1's input after the all-to-all, and the sort order
    expert SwiGLU     5·T·k·f_e / t·b         as the dense MLP, on the routed copies
    unpermute         T·k·h·b                 expert outputs, kept for the probability weighting
    shared expert     5·T·f_s / t·b + T·b     its SwiGLU, and the gate's output
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.models.moe import MoeSpec


@dataclass(frozen=True, kw_only=True)
class MoeDims:
    """The expert layout the memory model needs (from ``models.moe.MoeSpec``)."""

    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0  # 0: no shared expert
    shared_gate: bool = False
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)

    @classmethod
    def from_spec(cls, moe: MoeSpec) -> MoeDims:
        """Dims of a `MoeSpec`."""
        return cls(experts=moe.num_experts, top_k=moe.top_k, expert_ffn=moe.expert_ffn_hidden_size,
                   shared_ffn=moe.shared_expert_ffn_hidden_size or 0, shared_gate=moe.shared_expert_gate,
                   sparse_layers=moe.sparse_layers)  # fmt: skip


def sparse_layers_of_stage(moe: MoeDims | None, layers: int, pp: int, stage: int) -> int:
    """How many of `stage`'s layers (megatron's even split of `layers` over `pp`) are sparse."""
    if moe is None:
        return 0
    per = layers // pp
    return sum(moe.sparse_layers[stage * per : (stage + 1) * per])


def sparse_mlp_params(moe: MoeDims, hidden: int, tp: int, ep: int) -> tuple[int, int]:
    """(non-expert, routed-expert) parameters of one sparse layer's MoE block on one rank."""
    shared = 3 * hidden * moe.shared_ffn // tp + (hidden if moe.shared_gate else 0)
    experts = moe.experts // ep * 3 * hidden * moe.expert_ffn // tp
    return moe.experts * hidden + shared, experts


def sparse_mlp_activation_bytes(moe: MoeDims, hidden: int, tokens: int, tp: int, b: int) -> int:
    """Bytes one sparse layer's MoE block saves for the backward (module docstring)."""
    T, k = tokens, moe.top_k
    router = T * moe.experts * (b + 4) + 12 * T * k
    routed = T * k * (2 * hidden * b + 8) + 5 * T * k * moe.expert_ffn // tp * b
    shared = 5 * T * moe.shared_ffn // tp * b + (T * b if moe.shared_gate else 0)
    return router + routed + shared


def sparse_mlp_width(moe: MoeDims, tp: int) -> int:
    """Intermediate width per token of a sparse layer's MLPs on one rank (k routed + shared)."""
    return (moe.top_k * moe.expert_ffn + moe.shared_ffn) // tp
