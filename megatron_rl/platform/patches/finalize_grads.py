"""Scope megatron's ``finalize_model_grads`` to the policy chunk inside one tri-model schedule.

Why: megatron-core's pipeline schedules call ``config.finalize_model_grads_func(model_chunks)``
at the end of a backward schedule with the chunks they ran. The tri-model runs one schedule
over ``TriStage`` (policy + old + reference hidden streams together), but the function that
``wrap_for_training`` installed (DP all-reduce, tied-embedding sum, layer-norm grads) was made
for the DDP-wrapped policy only, and a trainer that accumulates several micro-steps must call
it once, after the last (summing twice is wrong).

How: for the duration of one schedule, the config's ``finalize_model_grads_func`` is replaced by
one bound to ``[policy]`` (``enabled=True``) or by None (``enabled=False``), and restored after.
Nothing global changes outside the ``with`` block.

Versions: megatron-core 0.16.x (``forward_backward_pipelining_*`` / ``no_pipelining`` read
``config.finalize_model_grads_func``). Delete when the schedules take the chunks to finalise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def scoped_finalize_model_grads(config, policy: torch.nn.Module, *, enabled: bool) -> Iterator[None]:
    """Within the block, ``config.finalize_model_grads_func`` finalises only ``policy`` (or nothing)."""
    original = config.finalize_model_grads_func
    if original is None:
        yield
        return
    if enabled:
        config.finalize_model_grads_func = lambda _chunks, *a, **kw: original([policy], *a, **kw)
    else:
        config.finalize_model_grads_func = None
    try:
        yield
    finally:
        config.finalize_model_grads_func = original
