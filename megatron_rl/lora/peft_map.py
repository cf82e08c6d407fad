"""PEFT adapter tensors <-> this rank's LoRA shards, by PEFT's names.

PEFT names an adapter tensor ``base_model.model.<HF module>.lora_A.weight`` / ``lora_B.weight``
(``get_peft_model_state_dict``'s keys, those of ``adapter_model.safetensors``). Each ``LoraPart``
is one such HF module (``q_proj``, ``k_proj``, ``v_proj`` of ``linear_qkv``; ``gate_proj``, ``up_proj``
of ``linear_fc1``; ``o_proj``; ``down_proj``), so the conversion only cuts or joins along TP:
column-parallel B by rows, row-parallel A by columns; the other tensor is replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from megatron_rl.lora.adapter import LoraPart
from megatron_rl.lora.apply import lora_adapters
from megatron_rl.models.hf_io import shard_info

PEFT_PREFIX = "base_model.model."


def peft_keys(part: LoraPart) -> tuple[str, str]:
    """PEFT's names of ``part``'s A and B."""
    return f"{PEFT_PREFIX}{part.hf_name}.lora_A.weight", f"{PEFT_PREFIX}{part.hf_name}.lora_B.weight"


def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Parameter, str, int | None]]:
    """(parameter, PEFT name, the dim TP splits it along or None: replicated) of every adapter tensor."""
    for adapter in lora_adapters(model):
        dims = (None, 0) if adapter.parallel == "column" else (1, None)
        for part in adapter.parts.values():
            yield from zip((part.lora_A, part.lora_B), peft_keys(part), dims, strict=True)


def load_peft_tensors(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy full PEFT adapter tensors (by PEFT's names) into this rank's shards of ``model``'s
    adapters (every adapter of this PP stage must find its two tensors)."""
    shard = shard_info(model)
    with torch.no_grad():
        for param, key, dim in adapter_tensors(model):
            if key not in tensors:
                raise KeyError(f"PEFT tensors have no {key!r}")
            value = tensors[key] if dim is None else tensors[key].chunk(shard.tp_size, dim=dim)[shard.tp_rank]
            if value.shape != param.shape:
                raise ValueError(f"{key}: shard {tuple(value.shape)}, adapter holds {tuple(param.shape)}")
            param.copy_(value)


def iter_peft_tensors(
    model: torch.nn.Module,
    gather_tp: Callable[[torch.Tensor], list[torch.Tensor]],
    *,
    grad: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (PEFT name, full tensor) for each adapter tensor of this PP stage, its gradient when
    ``grad``; ``gather_tp`` all-gathers a shard over the TP group (every TP rank must call)."""
    for param, key, dim in adapter_tensors(model):
        value = param.grad if grad else param
        if value is None:
            raise ValueError(f"{key} has no gradient")
        value = value.detach()
        yield key, value if dim is None else torch.cat(gather_tp(value), dim=dim)
