"""megatron's vocab-parallel cross entropy without the two host syncs of its boolean-mask writes.

Why: ``VocabParallelCrossEntropy.calculate_predicted_logits`` zeroes the targets and predicted
logits outside this TP rank's vocabulary slice with ``x[target_mask] = 0``: an ``index_put_`` with
a boolean mask, whose shape depends on the data. CUDA avoids the sync for a Python scalar (ATen
turns it into a masked fill), but for every other device PyTorch builds the value as a tensor and
the index runs ``nonzero`` (a device->host read), and torch_npu's index_put reads the value back
too: two host syncs in every log-prob computation (every micro-batch, every model copy) on an NPU.

How: the same function with ``torch.where`` in place of the two masked writes; values and
gradients are identical (the backward reads ``target_mask`` and ``masked_target_1d``, unchanged).
Applied on every platform by ``setup_platform`` (idempotent).

Versions: megatron-core 0.16.x (``megatron/core/tensor_parallel/cross_entropy.py``). Delete when
megatron writes these with ``masked_fill`` / ``where``.
"""

from __future__ import annotations

import torch


def calculate_predicted_logits(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    logits_max: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
):
    """megatron's ``calculate_predicted_logits`` (same inputs, outputs and in-place use of the
    logits), without data-dependent shapes."""
    vocab_parallel_logits -= logits_max.unsqueeze(dim=-1)  # in place, as megatron: less memory
    target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
    masked_target = torch.where(target_mask, 0, target - vocab_start_index)
    partition_vocab_size = vocab_parallel_logits.size()[-1]
    logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
    masked_target_1d = masked_target.view(-1)
    arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
    predicted_logits_1d = logits_2d[arange_1d, masked_target_1d].clone().contiguous()
    predicted_logits = torch.where(target_mask, 0.0, predicted_logits_1d.view_as(target))
    exp_logits = vocab_parallel_logits
    torch.exp(vocab_parallel_logits, out=exp_logits)
    sum_exp_logits = exp_logits.sum(dim=-1)
    return target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits


def apply() -> None:
    """Replace megatron's static method (idempotent)."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    VocabParallelCrossEntropy.calculate_predicted_logits = staticmethod(calculate_predicted_logits)
