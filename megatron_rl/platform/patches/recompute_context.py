"""Activation recompute keeps the forward's context variables (the packed attention layout).

Why: the shared-prompt core attention reads its layout from a ``ContextVar`` set by
``attention.context.packed_attention`` around the model call. megatron-core's recompute
(``recompute_granularity: full`` or ``selective``) re-runs the layer inside autograd's backward,
after that block has exited (and, on CUDA / NPU, on autograd's device thread, where context
variables are not inherited): the recomputed layer saw no layout and attended causally over the
whole pack, so its gradients were those of a different function.

How: ``megatron.core.tensor_parallel.checkpoint`` (the name transformer_block, transformer_layer
and attention call) is wrapped so that the checkpointed function runs in a copy of the context
taken at forward time, in the forward and in its recompute alike. Nothing else changes.

Versions: megatron-core 0.16.x (``tensor_parallel.random.checkpoint``). Keep while the layout
travels in a context variable; applied on every platform.
"""

from __future__ import annotations

import contextvars
import functools

_PATCHED_NAME = "_megatron_rl_keeps_context"


def apply() -> None:
    """Wrap megatron's ``tensor_parallel.checkpoint`` (idempotent)."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    original = mrandom.checkpoint
    if getattr(original, _PATCHED_NAME, False):
        return

    @functools.wraps(original)
    def checkpoint(function, distribute_saved_activations, *args):
        context = contextvars.copy_context()
        return original(functools.partial(context.run, function), distribute_saved_activations, *args)

    setattr(checkpoint, _PATCHED_NAME, True)
    mrandom.checkpoint = checkpoint
    tensor_parallel.checkpoint = checkpoint
