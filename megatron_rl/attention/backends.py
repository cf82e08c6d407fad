"""Backend dispatch of shared-prompt attention: one function, backend chosen by config/platform.

``attention.backend``: ``auto | reference | split | flex | triton | npu``. ``auto`` picks
``npu`` on Ascend, ``triton`` on CUDA (``flex`` when Triton is missing) and ``split`` on the
CPU. Every backend takes THD-packed tensors and an ``AttentionLayout`` (the layout_meta of a
``PackedMicroBatch``) and returns the same thing up to float rounding.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable
from typing import get_args

import torch

from megatron_rl.attention.flex import flex_attention_packed
from megatron_rl.attention.layout import AttentionLayout
from megatron_rl.attention.npu import npu_attention, torch_npu_available
from megatron_rl.attention.reference import reference_attention
from megatron_rl.attention.split import split_attention
from megatron_rl.attention.triton_backend import triton_attention
from megatron_rl.config.fields import require_values
from megatron_rl.config.schema import AttentionBackend, AttentionConfig

BACKENDS: tuple[str, ...] = get_args(AttentionBackend)  # the schema's attention.backend names

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionLayout, float], torch.Tensor]
_IMPLS: dict[str, AttentionFn] = {
    "reference": reference_attention,
    "split": split_attention,
    "flex": flex_attention_packed,
    "triton": triton_attention,
    "npu": npu_attention,
}


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def auto_backend(device_type: str, *, triton: bool = True) -> str:
    """What ``attention.backend: auto`` runs on ``device_type`` ('cpu' | 'cuda' | 'npu'), given
    whether triton is installed there (``plan`` assumes a CUDA machine has it)."""
    if device_type == "npu":
        return "npu"
    if device_type == "cuda":
        return "triton" if triton else "flex"
    return "split"


def resolve_backend(name: str, device_type: str, requires_grad: bool) -> str:
    """The concrete backend for ``name`` on ``device_type`` ('cpu' | 'cuda' | 'npu').

    Raises ``ValueError`` for an unknown name or a backend this platform cannot run."""
    require_values({"attention.backend": name})  # the config's rule: one of the schema's names
    if name == "auto":
        return auto_backend(device_type, triton=_triton_available())
    if name == "npu" and not torch_npu_available():
        raise ValueError("attention.backend='npu' needs torch_npu, which is not installed; use 'auto' or 'split'")
    if name == "flex" and device_type == "cpu" and requires_grad:
        raise ValueError(
            "attention.backend='flex' cannot train on the CPU: torch 2.13's CPU FlexAttention is "
            "forward-only (inputs requiring grad raise NotImplementedError); use 'split' on the CPU"
        )
    if name == "triton":
        if not _triton_available():
            raise ValueError("attention.backend='triton' needs the triton package; use 'flex' or 'auto'")
        if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention.backend='triton' on the CPU runs only under TRITON_INTERPRET=1 (tests)")
    return name


def shared_prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout_meta: AttentionLayout,
    *,
    backend: str = AttentionConfig.backend,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Shared-prompt attention of a packed micro-batch.

    q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` with Hq a multiple of Hkv (GQA), T =
    ``layout_meta.total_tokens``; returns ``[T, Hq, D]``. ``softmax_scale`` defaults to
    ``1/sqrt(D)``."""
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"expected q [T, Hq, D] and k, v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[0] != layout_meta.total_tokens or k.shape[0] != layout_meta.total_tokens:
        raise ValueError(f"q/k/v have {q.shape[0]}/{k.shape[0]} tokens, the layout has {layout_meta.total_tokens}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    requires_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    name = resolve_backend(backend, q.device.type, requires_grad)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _IMPLS[name](q, k, v, layout_meta, scale)
