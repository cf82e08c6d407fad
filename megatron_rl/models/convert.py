"""HF safetensors <-> megatron-core TP/PP shards, table-driven.

One table row per parameter kind says how the HF tensor(s) map onto one megatron parameter
and how it is split across tensor-parallel ranks:

- ``replicated``: norms; every TP rank holds the whole tensor.
- ``cols``: row-parallel linears (``linear_proj``, ``linear_fc2``), split on dim 1.
- ``vocab``: embedding / output layer rows, padded with zeros to megatron's padded vocabulary.
- ``qkv``: q, k, v fused per query group: for each KV group g the rows are
  ``[q heads of g; k_g; v_g]`` (megatron's ``linear_qkv`` layout); TP splits whole groups.
- ``fc1``: gate and up projections; TP rank r holds ``[gate_r; up_r]``.
- ``expert_fc1`` / ``expert_fc2``: one routed expert's ``fc1`` / ``cols`` (MoE layers). Local
  expert j of expert-parallel rank e is HF expert ``e * E / ep + j`` (megatron's order); the
  expert tensor-parallel size is megatron's default, the TP size.

Conversion is exact (pure reshapes and concatenations), so HF -> megatron -> HF is bit-exact.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_rl.models.hf_config import DecoderSpec

Kind = Literal["replicated", "cols", "vocab", "qkv", "fc1", "expert_fc1", "expert_fc2"]
EXPERT_KINDS = ("expert_fc1", "expert_fc2")


@dataclass(frozen=True)
class ParamRule:
    """How one megatron parameter (name pattern with ``{i}`` = layer) maps to HF tensors.

    MoE names (``{router}``, ``{gate}``, ``{up}``, ``{down}``) come from the family's
    ``MoeSpec``; a routed expert's rule, as ``match_rule`` returns it, also carries its local
    index and the expert-parallel size (its HF names are those of every EP rank's expert)."""

    mcore: str
    hf: tuple[str, ...]
    kind: Kind
    expert: int | None = None  # local expert index (expert kinds)
    ep: int = 1  # expert-parallel size (expert kinds)


LAYER_RULES = (
    ParamRule("decoder.layers.{i}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "replicated"),
    ParamRule(
        "decoder.layers.{i}.self_attention.linear_qkv.weight",
        tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"),
        "qkv",
    ),
    ParamRule(
        "decoder.layers.{i}.self_attention.linear_qkv.bias",
        tuple(f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"),
        "qkv",
    ),
    ParamRule(
        "decoder.layers.{i}.self_attention.q_layernorm.weight",
        ("model.layers.{i}.self_attn.q_norm.weight",),
        "replicated",
    ),
    ParamRule(
        "decoder.layers.{i}.self_attention.k_layernorm.weight",
        ("model.layers.{i}.self_attn.k_norm.weight",),
        "replicated",
    ),
    ParamRule(
        "decoder.layers.{i}.self_attention.linear_proj.weight", ("model.layers.{i}.self_attn.o_proj.weight",), "cols"
    ),
    ParamRule(
        "decoder.layers.{i}.pre_mlp_layernorm.weight",
        ("model.layers.{i}.post_attention_layernorm.weight",),
        "replicated",
    ),
    ParamRule(
        "decoder.layers.{i}.mlp.linear_fc1.weight",
        ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
        "fc1",
    ),
    ParamRule("decoder.layers.{i}.mlp.linear_fc2.weight", ("model.layers.{i}.mlp.down_proj.weight",), "cols"),
)
MOE_RULES = (
    ParamRule("decoder.layers.{i}.mlp.router.weight", ("model.layers.{i}.{router}",), "replicated"),
    ParamRule(
        "decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight",
        ("model.layers.{i}.{gate}", "model.layers.{i}.{up}"),
        "expert_fc1",
    ),
    ParamRule(
        "decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.weight", ("model.layers.{i}.{down}",), "expert_fc2"
    ),
    ParamRule(
        "decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight",
        ("model.layers.{i}.mlp.shared_expert.gate_proj.weight", "model.layers.{i}.mlp.shared_expert.up_proj.weight"),
        "fc1",
    ),
    ParamRule(
        "decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight",
        ("model.layers.{i}.mlp.shared_expert.down_proj.weight",),
        "cols",
    ),
    ParamRule(
        "decoder.layers.{i}.mlp.shared_experts.gate_weight",
        ("model.layers.{i}.mlp.shared_expert_gate.weight",),
        "replicated",
    ),
)
GLOBAL_RULES = (
    ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    ParamRule("output_layer.weight", ("lm_head.weight",), "vocab"),
)
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_NAME = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ShardInfo:
    """Where this rank's shard sits: TP rank/size, the megatron padded vocabulary, and the
    expert-parallel rank (the expert tensor-parallel rank is the TP rank)."""

    tp_rank: int
    tp_size: int
    padded_vocab: int
    ep_rank: int = 0
    ep_size: int = 1


def match_rule(local_name: str, layer_offset: int, ep: int = 1) -> tuple[ParamRule, int | None]:
    """Find the rule for a megatron parameter name; return it and the global layer index
    (``ep``: the expert-parallel size, for routed experts' names)."""
    m = _LAYER_NAME.match(local_name)
    if m:
        layer, rest = int(m.group(1)) + layer_offset, m.group(2)
        expert = _EXPERT_NAME.match(rest)
        for rule in (*LAYER_RULES, *MOE_RULES):
            pattern = rule.mcore.split("{i}.", 1)[1]
            if expert and pattern == f"mlp.experts.local_experts.{{j}}.{expert.group(2)}":
                return dataclasses.replace(rule, expert=int(expert.group(1)), ep=ep), layer
            if pattern == rest:
                return rule, layer
    for rule in GLOBAL_RULES:
        if rule.mcore == local_name:
            return rule, None
    raise KeyError(f"no HF mapping for megatron parameter {local_name!r}")


def hf_names(rule: ParamRule, layer: int | None, spec: DecoderSpec) -> tuple[str, ...]:
    """The HF tensor names that feed ``rule`` (the tied output layer reads the embedding); for
    a routed expert, those of the expert at every EP rank, EP rank major (the export order)."""
    if rule.mcore == "output_layer.weight" and spec.tie_word_embeddings:
        return ("model.embed_tokens.weight",)
    if spec.moe is None:
        return tuple(n.format(i=layer) for n in rule.hf)
    gate, up, down = spec.moe.expert_hf_names
    names = tuple(n.format(i=layer, router=spec.moe.router_hf_name, gate=gate, up=up, down=down) for n in rule.hf)
    if rule.kind not in EXPERT_KINDS:
        return names
    per_rank = spec.moe.num_experts // rule.ep
    return tuple(n.format(e=e * per_rank + rule.expert) for e in range(rule.ep) for n in names)


def load_names(rule: ParamRule, layer: int | None, spec: DecoderSpec, shard: ShardInfo) -> tuple[str, ...]:
    """The HF tensor names this rank's shard of ``rule`` is cut from (``hf_to_shard``'s input)."""
    names = hf_names(rule, layer, spec)
    if rule.kind not in EXPERT_KINDS:
        return names
    per = len(names) // rule.ep
    return names[shard.ep_rank * per : (shard.ep_rank + 1) * per]


def _qkv_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: DecoderSpec) -> torch.Tensor:
    groups, d = spec.num_key_value_heads, spec.head_dim
    per = spec.num_attention_heads // groups
    tail = q.shape[1:]
    q = q.reshape(groups, per * d, *tail)
    k, v = k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(groups * (per + 2) * d, *tail)


def _ungroup_qkv(qkv: torch.Tensor, spec: DecoderSpec) -> tuple[torch.Tensor, ...]:
    groups, d = spec.num_key_value_heads, spec.head_dim
    per = spec.num_attention_heads // groups
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per + 2) * d, *tail)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_shard(rule: ParamRule, tensors: Sequence[torch.Tensor], spec: DecoderSpec, shard: ShardInfo) -> torch.Tensor:
    """Build this TP rank's shard of one megatron parameter from its HF tensors
    (``load_names``: for a routed expert, this EP rank's expert only)."""
    r, tp = shard.tp_rank, shard.tp_size
    if rule.kind == "replicated":
        return tensors[0]
    if rule.kind == "cols":
        return tensors[0].chunk(tp, dim=1)[r]
    if rule.kind == "vocab":
        full = tensors[0]
        padded = full.new_zeros((shard.padded_vocab, *full.shape[1:]))
        padded[: full.shape[0]] = full
        return padded.chunk(tp, dim=0)[r]
    if rule.kind == "qkv":
        return _qkv_groups(*tensors, spec).chunk(tp, dim=0)[r]
    if rule.kind in ("fc1", "expert_fc1"):
        gate, up = (t.chunk(tp, dim=0)[r] for t in tensors)
        return torch.cat([gate, up], dim=0)
    if rule.kind == "expert_fc2":
        return tensors[0].chunk(tp, dim=1)[r]
    raise AssertionError(rule.kind)


def shards_to_hf(rule: ParamRule, shards: Sequence[torch.Tensor], spec: DecoderSpec) -> tuple[torch.Tensor, ...]:
    """Reassemble the full HF tensors of one parameter from all TP ranks' shards (in rank order;
    a routed expert: the shards of its expert tensor-and-model-parallel group, TP fastest)."""
    if rule.kind in EXPERT_KINDS:
        etp = len(shards) // rule.ep
        dense = dataclasses.replace(rule, kind="fc1" if rule.kind == "expert_fc1" else "cols")
        return tuple(t for e in range(rule.ep) for t in shards_to_hf(dense, shards[e * etp : (e + 1) * etp], spec))
    if rule.kind == "replicated":
        return (shards[0],)
    if rule.kind == "cols":
        return (torch.cat(shards, dim=1),)
    if rule.kind == "vocab":
        return (torch.cat(shards, dim=0)[: spec.vocab_size],)
    if rule.kind == "qkv":
        return _ungroup_qkv(torch.cat(shards, dim=0), spec)
    if rule.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return (torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves]))
    raise AssertionError(rule.kind)


def load_shards_into(
    model: torch.nn.Module,
    read_hf: Callable[[str], torch.Tensor],
    spec: DecoderSpec,
    shard: ShardInfo,
    layer_offset: int,
) -> None:
    """Copy HF weights (fetched by name with ``read_hf``) into this rank's megatron parameters."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            rule, layer = match_rule(name, layer_offset, shard.ep_size)
            tensors = [read_hf(n) for n in load_names(rule, layer, spec, shard)]
            value = hf_to_shard(rule, tensors, spec, shard)
            if value.shape != param.shape:
                raise ValueError(
                    f"{name}: HF tensors {load_names(rule, layer, spec, shard)} give shape "
                    f"{tuple(value.shape)}, model expects {tuple(param.shape)}"
                )
            param.copy_(value)


def iter_export(
    model: torch.nn.Module,
    gather_tp: Callable[[torch.Tensor], list[torch.Tensor]],
    spec: DecoderSpec,
    *,
    layer_offset: int,
    gather_experts: Callable[[torch.Tensor], list[torch.Tensor]] | None = None,
    ep: int = 1,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for each of this PP stage's parameters, one at a time.

    ``gather_tp`` all-gathers a shard over the TP group (identity list at TP=1),
    ``gather_experts`` a routed expert's over the expert tensor-and-model-parallel group
    (``ep`` ranks). Tied output layers are skipped: HF stores them once, as the embedding.
    """
    for name, param in model.named_parameters():
        rule, layer = match_rule(name, layer_offset, ep)
        if rule.mcore == "output_layer.weight" and spec.tie_word_embeddings:
            continue
        if rule.kind in EXPERT_KINDS:
            shards = (gather_experts or gather_tp)(param.detach())
        else:
            shards = [param.detach()] if rule.kind == "replicated" else gather_tp(param.detach())
        full = shards_to_hf(rule, shards, spec)
        yield from zip(hf_names(rule, layer, spec), full, strict=True)
