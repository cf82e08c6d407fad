"""One megatron linear's LoRA adapter: PEFT's per-projection adapters, sharded as the linear is.

A column-parallel linear (output rows split over TP: ``linear_qkv``, ``linear_fc1``) holds each
part's A replicated [r, in] and B split by output rows [out / tp, r]; the low-rank activation
``A x`` enters the TP region through ``copy_to_tensor_model_parallel_region`` (identity forward,
all-reduce backward), so A's gradient sums every rank's rows. A row-parallel linear (input split
over TP: ``linear_proj``, ``linear_fc2``) holds A split by input columns [r, in / tp]; its partial
``A_t x_t`` is all-reduced (``reduce_from_tensor_model_parallel_region``) before B [out, r],
replicated. Fused linears hold one part per HF projection and lay the parts' rows out with
``models.convert``'s own rules (``qkv``: per query group ``[q heads; k; v]``; ``fc1``:
``[gate; up]``), applied to this rank's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from megatron_rl.models.convert import ParamRule, ShardInfo, hf_to_shard
from megatron_rl.models.hf_config import DecoderSpec

Parallel = Literal["column", "row"]
_WHOLE = ShardInfo(tp_rank=0, tp_size=1, padded_vocab=0)  # convert's rules on tensors already local


class LoraPart(torch.nn.Module):
    """One PEFT adapter (one HF projection, ``hf_name``) as this TP rank holds it: ``lora_A``
    [r, in] and ``lora_B`` [out / tp, r] on a column-parallel linear, ``lora_A`` [r, in / tp] and
    ``lora_B`` [out, r] on a row-parallel one."""

    def __init__(self, lora_a: torch.Tensor, lora_b: torch.Tensor, hf_name: str):
        super().__init__()
        self.lora_A = torch.nn.Parameter(lora_a)
        self.lora_B = torch.nn.Parameter(lora_b)
        self.hf_name = hf_name


@dataclass(frozen=True)
class FusedLayout:
    """How the parts' output rows make up the base linear's local rows: ``rule`` is
    ``models.convert``'s (kind ``qkv`` or ``fc1``; None: a single part) and ``local_spec`` the
    model's spec with this TP rank's heads and query groups."""

    rule: ParamRule | None
    local_spec: DecoderSpec

    def combine(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The parts' tensors (rows on dim 0) fused into the base linear's local row order."""
        if self.rule is None:
            (only,) = tensors
            return only
        return hf_to_shard(self.rule, tensors, self.local_spec, _WHOLE)


class LoraAdapter(torch.nn.Module):
    """``scale * B(A(dropout(x)))`` of every part, in the base linear's output layout (this rank's
    shard of it on a column-parallel linear, the whole output on a row-parallel one)."""

    def __init__(
        self, parts: Sequence[LoraPart], *, parallel: Parallel, layout: FusedLayout, scale: float, dropout: float
    ):
        super().__init__()
        if parallel == "row" and len(parts) != 1:
            raise ValueError(f"a row-parallel linear holds one adapter, got {len(parts)}")
        self.parts = torch.nn.ModuleDict({p.hf_name.rsplit(".", 1)[-1]: p for p in parts})
        self.parallel, self.layout, self.scale, self.dropout = parallel, layout, scale, dropout
        self.off = False  # lora.switch.adapters_off: the hook adds nothing (the base linear alone)
        # lora.switch.adapters_from: (A, B) per part used instead of the parameters (no dropout)
        self.swapped: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None

    def weights(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """(A, B) of each part as the forward uses them: the swapped-in snapshot's, else the parameters."""
        if self.swapped is not None:
            return self.swapped
        return tuple((p.lora_A, p.lora_B) for p in self.parts.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's term for input ``x`` (the base linear's input, [s, b, in or in / tp])."""
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region as enter_tp
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as reduce_tp

        pairs = self.weights()
        if self.parallel == "row":
            ((a, b),) = pairs
            return self.scale * F.linear(reduce_tp(F.linear(self._drop(x), a)), b)
        ys = [F.linear(enter_tp(F.linear(self._drop(x), a)), b) for a, b in pairs]
        return self.scale * self.layout.combine([y.movedim(-1, 0) for y in ys]).movedim(0, -1)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # One mask per part, as PEFT's separate q / k / v (gate / up) modules draw; a swapped-in
        # snapshot (the old policy, scored without grad) runs as in eval mode.
        training = self.training and self.swapped is None
        return F.dropout(x, self.dropout, training) if self.dropout else x

    def delta(self) -> torch.Tensor:
        """``scale * B A`` for this rank's shard of the base weight (its shape and row order)."""
        return self.scale * self.layout.combine([p.lora_B @ p.lora_A for p in self.parts.values()])


def add_lora_output(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
    """Forward hook on an adapted megatron linear: its ``(output, bias)`` with the adapter's term
    added to the output (with ``skip_bias_add`` the bias stays apart, as megatron returns it)."""
    if module.lora.off:
        return output
    out, bias = output
    return out + module.lora(args[0]), bias


@torch.no_grad()
def merged_weight(module: torch.nn.Module) -> torch.Tensor:
    """This rank's shard of the adapted linear's merged weight ``W + scale * B A`` (a new tensor,
    the base weight's shape, dtype and layout), what a weight sync of the adapted layer sends."""
    return (module.weight + module.lora.delta().to(module.weight.dtype)).detach()
