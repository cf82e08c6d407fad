"""``npu`` backend: ``torch_npu.npu_fusion_attention`` in TND layout (Ascend).

The call is built by ``megatron_rl_kernels.npu_args`` (pure PyTorch, unit-tested on CPU
against an emulation of the operator); this module only issues it. Backward is the
operator's own (``npu_fusion_attention_grad``, wired into autograd by torch_npu); the K/V
gather's backward sums the prompt's gradients over its copies.
"""

from __future__ import annotations

import importlib.util

import torch

from megatron_rl.attention.layout import AttentionLayout


def torch_npu_available() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def npu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, softmax_scale: float
) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` on an NPU -> ``[T, Hq, D]``."""
    if not torch_npu_available():
        raise RuntimeError("attention backend 'npu' needs torch_npu (pip install torch_npu on an Ascend host)")
    import torch_npu

    # `megatron_rl_kernels` is kernels/ of this distribution (named apart from PyPI's `kernels`).
    from megatron_rl_kernels.npu_args import build_npu_fusion_args, npu_fusion_call

    fa = layout.cached_plan(
        ("npu", q.device),
        lambda: build_npu_fusion_args(
            [g.prompt_len for g in layout.groups], [g.response_lens for g in layout.groups], q.device
        ),
    )
    call = npu_fusion_call(q, k, v, fa, softmax_scale)
    return torch_npu.npu_fusion_attention(*call.args, **call.kwargs)[0]
