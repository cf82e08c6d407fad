"""The packed layout of the micro-batch being forwarded, visible to every attention layer.

The trainer wraps each model call in ``packed_attention(layout)``; the shared-prompt core
attention modules read it with ``current_layout()``. Outside such a block the model sees
plain causal sequences (``[b, s]`` batches, as in generation-free evaluation and parity).
Only the forward pass reads it: backward uses tensors saved by autograd, so pipeline
schedules that interleave micro-batches are safe. Under context parallelism the block also
carries this rank's ``CPSlice`` (``current_cp()``): the model then sees the rank's tokens only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from megatron_rl.attention.cp_split import CPSlice
from megatron_rl.attention.layout import AttentionLayout

_CURRENT: ContextVar[AttentionLayout | None] = ContextVar("megatron_rl_packed_layout", default=None)
_CP: ContextVar[CPSlice | None] = ContextVar("megatron_rl_cp_slice", default=None)


@contextlib.contextmanager
def packed_attention(layout: AttentionLayout | None, cp: CPSlice | None = None) -> Iterator[None]:
    """Make ``layout`` the attention geometry of model calls inside the block (None = causal);
    ``cp``: this rank's context-parallel slice of it (the model is fed those tokens only)."""
    if cp is not None and layout is None:
        raise ValueError("a context-parallel slice needs the packed layout it slices")
    token, cp_token = _CURRENT.set(layout), _CP.set(cp)
    try:
        yield
    finally:
        _CURRENT.reset(token)
        _CP.reset(cp_token)


def current_cp() -> CPSlice | None:
    """This rank's context-parallel slice set by the innermost ``packed_attention``, or None."""
    return _CP.get()


def current_layout() -> AttentionLayout | None:
    """The layout set by the innermost ``packed_attention`` block, or None."""
    return _CURRENT.get()
