"""megatron-core's MoE layer off CUDA: without Transformer Engine, on the CPU, the emulated
accelerator or an NPU.

Why (megatron-core 0.16.x, ``megatron/core/transformer/moe/``):

1. ``moe_utils`` imports ``te_general_gemm`` inside ``try: import transformer_engine`` but its
   router gating (``RouterGatingLinearFunction``) tests ``te_general_gemm is not None``
   unguarded: without TE every MoE forward raises ``NameError``. Defining the name as None
   selects megatron's own ``torch.mm`` branch (the fused MoE kernels stay unused: the configs
   here set ``moe_permute_fusion`` / ``moe_router_fusion`` off).
2. The all-to-all dispatcher moves its split sizes to the host with
   ``maybe_move_tensor_to_cpu``, which only acts on ``tensor.is_cuda``: elsewhere they stay
   tensors and ``all_to_all_single`` refuses them as split sizes ("incompatible function
   arguments"). The replacement copies any device's tensor to the host (numpy when asked).
   (``torch.cuda.Stream`` for its side stream comes from ``cpu_torch_proxy``.)

Delete when moe_utils defines the name in its ImportError branch and the host copy tests the
device type instead of ``is_cuda``.
"""

from __future__ import annotations

import torch


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``maybe_move_tensor_to_cpu`` for every device: a host copy (numpy when ``as_numpy``)."""
    if not torch.is_tensor(tensor):
        return tensor
    if tensor.is_cuda:  # megatron's own path (non-blocking copy on its side stream)
        return _ORIGINAL["to_host"](tensor, as_numpy=as_numpy, record_stream=record_stream)
    host = tensor.to("cpu")
    return host.numpy() if as_numpy else host


_ORIGINAL: dict[str, object] = {}


def apply() -> None:
    """Patch ``moe_utils`` / ``token_dispatcher`` as the module doc says (idempotent)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if "to_host" not in _ORIGINAL:
        _ORIGINAL["to_host"] = moe_utils.maybe_move_tensor_to_cpu
        token_dispatcher.maybe_move_tensor_to_cpu = _to_host
