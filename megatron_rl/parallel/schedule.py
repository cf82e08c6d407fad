"""Run megatron-core's pipeline schedule (1F1B at PP > 1, plain loop at PP = 1) over micro-batches.

The caller supplies ``forward_step(model, micro_batch) -> output`` and
``loss(output, micro_batch) -> (loss_tensor, payload)``: the losses of all micro-batches are
summed and backpropagated (unless ``forward_only``), the payloads collected on the last stage. Micro-batches may have
different sequence lengths (``variable_seq_lengths`` is set on the model config).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch


def run_schedule(
    model: torch.nn.Module | list[torch.nn.Module],
    micro_batches: Sequence[Any],
    *,
    forward_step: Callable[[torch.nn.Module, Any], torch.Tensor],
    loss: Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]],
    seq_length: Callable[[Any], int],
    forward_only: bool,
) -> list[Any]:
    """Forward (and backward) every micro-batch through the PP stages; payloads on the last stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = model if isinstance(model, list) else [model]
    payloads: list[Any] = []
    it = iter(micro_batches)

    def step(data_iterator, stage_model):
        mb = next(data_iterator)

        def loss_fn(output):
            value, payload = loss(output, mb)
            payloads.append(payload)
            # megatron divides each micro-batch loss by num_microbatches (mean semantics); our
            # losses are already normalised by the whole batch's denominator, so undo it.
            return value * len(micro_batches), {}

        return forward_step(stage_model, mb), loss_fn

    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad_mode:
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=it,
            model=chunks,
            num_microbatches=len(micro_batches),
            seq_length=max(seq_length(mb) for mb in micro_batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )
    return payloads
