"""``triton`` backend: dispatch to the block-sparse Triton kernel in ``megatron_rl_kernels``.

Triton is imported only when this backend runs. On the CPU the kernel runs only under
``TRITON_INTERPRET=1`` (tests, tiny shapes). ``triton_attention`` is the single-rank call (every
packed position is a query row); ``triton_rows_attention`` the context-parallel one (a CP rank's
rows against the whole gathered K / V, ``attention.context_parallel``).
"""

from __future__ import annotations

import torch

from megatron_rl.attention.cp_split import CPSlice
from megatron_rl.attention.layout import AttentionLayout

# Query/key block edge of the kernel; the CPU interpreter is run with small blocks in tests.
DEFAULT_BLOCK = 64


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    softmax_scale: float,
    *,
    block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
    # The kernels ship in this distribution as `megatron_rl_kernels` (setup.py maps kernels/ to it):
    # a top-level `kernels` package exists on PyPI and is probed by transformers.
    from megatron_rl_kernels.triton_shared_prompt import (
        build_block_plan,
        shared_prompt_flash_attention,
    )

    plan = layout.cached_plan(
        ("triton", q.device, block),
        lambda: build_block_plan(
            layout.group_start, layout.prefix_end, layout.seg_start, block_m=block, block_n=block, device=q.device
        ),
    )
    return shared_prompt_flash_attention(q, k, v, plan, softmax_scale)


def triton_rows_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_slice: CPSlice,
    layout: AttentionLayout,
    *,
    softmax_scale: float,
    block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """``triton`` under CP: local q ``[T_r, Hq, D]`` (the rank's packed positions
    ``cp_slice.local_index``), whole k / v ``[T, Hkv, D]`` -> ``[T_r, Hq, D]``; backward gives dK /
    dV over all T keys from this rank's queries."""
    from megatron_rl_kernels.triton_shared_prompt import build_block_plan, shared_prompt_flash_attention

    def build():
        rows = cp_slice.local_index
        gs, pe, ss = (x[rows] for x in (layout.group_start, layout.prefix_end, layout.seg_start))
        n = layout.total_tokens
        return build_block_plan(gs, pe, ss, block_m=block, block_n=block, device=q.device, q_pos=rows, num_keys=n)

    plan = layout.cached_plan(("cp_triton", cp_slice.cp, cp_slice.rank, q.device, block), build)
    return shared_prompt_flash_attention(q, k, v, plan, softmax_scale)
