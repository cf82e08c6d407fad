"""Megatron-core core-attention submodule that runs shared-prompt attention on packed groups.

It replaces ``DotProductAttention`` in the local layer spec (see ``models.builder``). Inside
``packed_attention(layout)`` it treats the ``[T, 1]`` input as one THD micro-batch and calls
``shared_prompt_attention`` with the configured backend; outside, it is ordinary causal
attention over each row of a ``[s, b]`` batch. Heads are this TP rank's slice, as megatron
hands them over; GQA is resolved by the backends. Under context parallelism (a ``CPSlice`` in
the block) the ``[T_r, 1]`` input is this rank's slice and ``attention.context_parallel``
all-gathers K / V over megatron's CP group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rl.attention.backends import resolve_backend, shared_prompt_attention
from megatron_rl.attention.context import current_cp, current_layout
from megatron_rl.attention.context_parallel import cp_attention
from megatron_rl.config.schema import AttentionConfig


class SharedPromptCoreAttention(torch.nn.Module):
    """``core_attention`` for megatron's ``SelfAttention``: [s, b, h, d] q/k/v -> [s, b, h*d]."""

    def __init__(
        self,
        config,
        *,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        backend: str = AttentionConfig.backend,
    ):
        """megatron-core 0.16's ``CoreAttentionBuilder`` (``SelfAttention`` passes every argument by
        keyword); ``backend``: ``attention.backend``, bound by ``models.builder``'s layer spec."""
        super().__init__()
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) != 0:
            raise ValueError("shared-prompt attention does not implement attention dropout; set it to 0")
        self.config = config
        self.cp_group = getattr(pg_collection, "cp", None)  # megatron's CP group (None: parallel_state's)
        self.backend = backend
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        *,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        """[s, b, h, d] q/k/v -> [s, b, h*d]; megatron passes q, k, v and the mask by position, the rest by keyword."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("shared-prompt attention takes its layout from packed_attention(), not megatron args")
        s, b, heads, dim = query.shape
        layout = current_layout()
        if layout is None:
            out = self._causal(query, key, value)
        else:
            if b != 1:
                raise ValueError(f"a packed micro-batch is one row of T tokens; got batch size {b}")
            cp = current_cp()
            if cp is not None and cp.cp > 1:
                return self._context_parallel(query, key, value, layout, cp).reshape(s, b, heads * dim)
            out = shared_prompt_attention(
                query[:, 0], key[:, 0], value[:, 0], layout, backend=self.backend, softmax_scale=self.softmax_scale
            )
            out = out.unsqueeze(1)
        return out.reshape(s, b, heads * dim)

    def _context_parallel(self, query, key, value, layout, cp):
        """This CP rank's rows ``[T_r, 1, h, d]`` (see ``attention.context_parallel``)."""
        from megatron.core import parallel_state

        requires_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
        name = self.backend
        if name == "auto" and query.device.type == "cuda":
            name = "flex"  # auto under CP: triton's CP path is checked under the CPU interpreter only
        name = resolve_backend(name, query.device.type, requires_grad)
        group = self.cp_group if self.cp_group is not None else parallel_state.get_context_parallel_group()
        out = cp_attention(
            query[:, 0], key[:, 0], value[:, 0], layout, cp, backend=name, group=group, softmax_scale=self.softmax_scale
        )
        return out.unsqueeze(1)

    def _causal(self, query, key, value):
        # [s, b, h, d] -> [b, h, s, d]; GQA by repeating KV heads.
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3)
