"""Put LoRA adapters on a megatron ``GPTModel``'s targeted linears and freeze everything else."""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Iterator

import torch

from megatron_rl.lora.adapter import FusedLayout, LoraAdapter, LoraPart, Parallel, add_lora_output
from megatron_rl.lora.settings import LoraSettings
from megatron_rl.models.convert import EXPERT_KINDS, ParamRule, ShardInfo, hf_names, match_rule
from megatron_rl.models.hf_config import DecoderSpec
from megatron_rl.models.hf_io import layer_offset, shard_info


def apply_lora(model: torch.nn.Module, settings: LoraSettings, spec: DecoderSpec) -> list[str]:
    """Adapt this PP stage's ``settings.target_modules`` of ``model`` (built from ``spec`` by
    ``megatron_rl.models``, parallel state set up) and freeze every non-adapter parameter; return
    the adapted modules' names. Routed MoE experts' linears are not adapted."""
    for param in model.parameters():
        param.requires_grad_(False)
    shard, offset = shard_info(model), layer_offset(model)
    adapted = []
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] not in settings.target_modules:
            continue
        rule, layer = match_rule(f"{name}.weight", offset, shard.ep_size)
        if rule.kind in EXPERT_KINDS:
            continue
        if hasattr(module, "lora"):
            raise ValueError(f"{name} already has a LoRA adapter (apply_lora ran twice on this model)")
        names = tuple(n.removesuffix(".weight") for n in hf_names(rule, layer, spec))
        module.lora = _adapter(module, rule, names, settings=settings, spec=spec, shard=shard, where=name)
        module.register_forward_hook(add_lora_output)
        adapted.append(name)
    if not adapted:
        raise ValueError(f"no module of this stage matches LoRA targets {settings.target_modules}")
    return adapted


def lora_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The adapter parameters of ``model`` (every part's ``lora_A`` and ``lora_B``), what the
    optimizer steps; empty for a model without adapters."""
    return [p for part in model.modules() if isinstance(part, LoraPart) for p in (part.lora_A, part.lora_B)]


def lora_adapters(model: torch.nn.Module) -> Iterator[LoraAdapter]:
    """Every adapter of ``model``, in module order."""
    return (m for m in model.modules() if isinstance(m, LoraAdapter))


def _parallel_kind(module: torch.nn.Module, where: str) -> Parallel:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear) and not module.gather_output and not module.sequence_parallel:
        return "column"
    if isinstance(module, RowParallelLinear) and module.input_is_parallel and not module.sequence_parallel:
        return "row"
    raise TypeError(
        f"{where}: LoRA adapts megatron-core's local ColumnParallelLinear (gather_output off) and "
        f"RowParallelLinear (input_is_parallel) without sequence parallelism, as models.builder "
        f"builds them; got {type(module).__name__}"
    )


def _adapter(module, rule: ParamRule, names: tuple[str, ...], *, settings, spec, shard: ShardInfo, where: str):
    """The adapter of one linear: B zeros, A kaiming-uniform (a = sqrt 5, PEFT's) of the full
    [r, in] from a generator seeded by ``settings.seed`` and the HF name, then sharded."""
    parallel = _parallel_kind(module, where)
    tp, weight = shard.tp_size, module.weight
    local_spec = dataclasses.replace(
        spec, num_attention_heads=spec.num_attention_heads // tp, num_key_value_heads=spec.num_key_value_heads // tp
    )
    if parallel == "row":
        rows, full_in = [weight.shape[0]], weight.shape[1] * tp
    elif rule.kind == "qkv":
        q, kv = local_spec.num_attention_heads * spec.head_dim, local_spec.num_key_value_heads * spec.head_dim
        rows, full_in = [q, kv, kv], weight.shape[1]
    else:
        rows, full_in = [weight.shape[0] // len(names)] * len(names), weight.shape[1]
    if sum(rows) != weight.shape[0] or len(rows) != len(names):
        raise ValueError(f"{where}: parts {names} of {rows} rows do not tile its {weight.shape[0]} rows")
    parts = []
    for hf_name, out in zip(names, rows, strict=True):
        a = torch.empty(settings.rank, full_in)
        generator = torch.Generator().manual_seed(settings.seed * 2**32 + zlib.crc32(hf_name.encode()))
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        if parallel == "row":
            a = a.chunk(tp, dim=1)[shard.tp_rank]
        b = torch.zeros(out, settings.rank)
        parts.append(_tp_marked(LoraPart(a.to(weight), b.to(weight), hf_name), parallel))
    layout = FusedLayout(rule=rule if len(parts) > 1 else None, local_spec=local_spec)
    return LoraAdapter(parts, parallel=parallel, layout=layout, scale=settings.scale, dropout=settings.dropout)


def _tp_marked(part: LoraPart, parallel: Parallel) -> LoraPart:
    """Megatron's TP attributes on the part's split tensor (column: B by rows, row: A by columns),
    so the grad norm counts every rank's shard once and the replicated tensor once."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    split, dim = (part.lora_B, 0) if parallel == "column" else (part.lora_A, 1)
    set_tensor_model_parallel_attributes(split, True, dim, 1)
    return part
