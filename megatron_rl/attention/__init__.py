"""Shared-prompt attention: the packed group layout, packing/unpacking, and backend dispatch.

Public API: ``TokenGroup``, ``PackedGroup``, ``PackedMicroBatch``, ``pack_group``,
``pack_groups``, ``k_copies``, ``unpack_logprobs``, ``unpack_logprobs_padded``,
``AttentionLayout``, ``GroupSpan``, ``shared_prompt_attention``, ``resolve_backend``,
``BACKENDS``. Triton and torch_npu are imported only when their backend runs.
"""

from megatron_rl.attention.backends import (
    BACKENDS,
    resolve_backend,
    shared_prompt_attention,
)
from megatron_rl.attention.layout import AttentionLayout, GroupSpan
from megatron_rl.attention.packing import (
    PackedGroup,
    PackedMicroBatch,
    TokenGroup,
    k_copies,
    pack_group,
    pack_groups,
    unpack_logprobs,
    unpack_logprobs_padded,
)

__all__ = [
    "BACKENDS",
    "AttentionLayout",
    "GroupSpan",
    "PackedGroup",
    "PackedMicroBatch",
    "TokenGroup",
    "k_copies",
    "pack_group",
    "pack_groups",
    "resolve_backend",
    "shared_prompt_attention",
    "unpack_logprobs",
    "unpack_logprobs_padded",
]
