"""The packed layout of the micro-batch being forwarded, visible to every attention layer.

The trainer wraps each model call in ``packed_attention(layout)``; the shared-prompt core
attention modules read it with ``current_layout()``. Outside such a block the model sees
plain causal sequences (``[b, s]`` batches, as in generation-free evaluation and parity).
Only the forward pass reads it: backward uses tensors saved by autograd, so pipeline
schedules that interleave micro-batches are safe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from megatron_rl.attention.layout import AttentionLayout

_CURRENT: ContextVar[AttentionLayout | None] = ContextVar("megatron_rl_packed_layout", default=None)


@contextlib.contextmanager
def packed_attention(layout: AttentionLayout | None) -> Iterator[None]:
    """Make ``layout`` the attention geometry of model calls inside the block (None = causal)."""
    token = _CURRENT.set(layout)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_layout() -> AttentionLayout | None:
    """The layout set by the innermost ``packed_attention`` block, or None."""
    return _CURRENT.get()
