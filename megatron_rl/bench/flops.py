"""Training FLOPs from the architecture, and the peak FLOP/s of the device they are measured against.

FLOPs of one trained micro-step, counted on the *packed* shared-prompt layout (DESIGN §1): a
group of K responses is ``[prompt, r_1..r_K]``, so every non-attention layer sees
``Lp + ΣLr`` tokens (the prompt once per group, not K times) and attention scores only the
allowed (query, key) pairs: ``Lp(Lp+1)/2`` in the prompt plus ``Lr_i·Lp + Lr_i(Lr_i+1)/2`` per
response.

- dense: ``2·N`` per token forward (N = matmul parameters: attention and MLP projections of
  every layer plus the output layer; embeddings are lookups), ``×3`` with the backward
  (the usual 6·N·tokens of Kaplan et al. 2020 / the PaLM MFU appendix);
- mixture of experts: only the *active* parameters count: a sparse layer's MLP is its router
  (``h·E``), the ``top_k`` routed experts every token goes through (``top_k·3·h·f_e``, not all
  E of them) and the shared expert (``3·h·f_s`` and its gate) where the model has one;
- attention: ``4·layers·heads·head_dim`` per allowed pair forward (QKᵀ and PV), ``×3`` with
  the backward;
- every frozen copy the tri-model runs (old policy, reference) adds one forward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the CLI's argument parser reads DEVICES
    import torch

    from megatron_rl.models import DecoderSpec

# Dense (no sparsity) bf16 peak TFLOP/s per device.
PEAK_TFLOPS: dict[str, float] = {
    # Ascend 910B: Huawei's only published figure is the original Ascend 910's 256 TFLOPS FP16
    # (Hot Chips 31, 2019); for the 910B there is no public per-SKU datasheet. Third-party reports
    # quote ~313 TFLOPS FP16/BF16 for the 910B3 (Atlas 800T A2), ~320-376 for 910B1/B2 and less for
    # 910B4: the table takes the 910B3 figure; pass --peak-tflops for another SKU.
    "910b": 313.0,
    "h100": 989.0,  # NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense BF16 (1979 with sparsity)
    "h200": 989.0,  # NVIDIA H200 datasheet: same Hopper tensor cores as H100 SXM, 989 dense BF16
    "a100": 312.0,  # NVIDIA A100 datasheet: 312 TFLOPS dense BF16 (624 with sparsity)
}
DEVICES = (*PEAK_TFLOPS, "cpu")


@dataclass(frozen=True, kw_only=True)
class GroupShape:
    """Token counts of one trained group (or part of one): its prompt and its responses."""

    prompt_len: int
    response_lens: tuple[int, ...]

    @property
    def packed_tokens(self) -> int:
        """Tokens of ``[prompt, r_1..r_K]``: what every non-attention layer processes."""
        return self.prompt_len + sum(self.response_lens)

    @property
    def sample_tokens(self) -> int:
        """Prompt + response tokens of every sample (prompt counted K times, as MindSpeed-RL counts)."""
        return len(self.response_lens) * self.prompt_len + sum(self.response_lens)

    @property
    def attention_pairs(self) -> int:
        """Allowed (query, key) pairs of the shared-prompt mask."""
        p = self.prompt_len
        return p * (p + 1) // 2 + sum(r * p + r * (r + 1) // 2 for r in self.response_lens)


def matmul_params(spec: DecoderSpec) -> int:
    """Parameters that multiply each token's activations: q/k/v/o and MLP of every layer (a MoE
    layer's router, top-k routed experts and shared expert: its active parameters), output layer."""
    h, d = spec.hidden_size, spec.head_dim
    attn = h * spec.num_attention_heads * d + 2 * h * spec.num_key_value_heads * d + spec.num_attention_heads * d * h
    dense_mlp = 3 * h * spec.ffn_hidden_size  # gated (SwiGLU): gate, up, down
    sparse = sum(spec.moe.sparse_layers) if spec.moe is not None else 0
    total = spec.num_layers * attn + (spec.num_layers - sparse) * dense_mlp + h * spec.vocab_size
    if sparse:
        moe = spec.moe
        shared = 3 * h * (moe.shared_expert_ffn_hidden_size or 0) + (h if moe.shared_expert_gate else 0)
        total += sparse * (h * moe.num_experts + moe.top_k * 3 * h * moe.expert_ffn_hidden_size + shared)
    return total


def training_flops(spec: DecoderSpec, groups: Sequence[GroupShape], *, frozen_forwards: int = 0) -> float:
    """FLOPs of training ``groups`` once (policy forward + backward, plus ``frozen_forwards``
    extra forwards of old / reference copies), counted on the shared-prompt layout."""
    tokens = sum(g.packed_tokens for g in groups)
    pairs = sum(g.attention_pairs for g in groups)
    per_pair = 4.0 * spec.num_layers * spec.num_attention_heads * spec.head_dim  # QK^T and PV, 2 FLOPs per MAC
    forward = 2.0 * matmul_params(spec) * tokens + per_pair * pairs
    return forward * (3 + frozen_forwards)


def measure_cpu_tflops(dtype: torch.dtype, size: int = 512, seconds: float = 0.3) -> float:
    """This process's matmul throughput (TFLOP/s) at its torch thread count: the CPU 'peak'."""
    import torch

    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or n < 3:
        torch.mm(a, b)
        n += 1
    return 2.0 * size**3 * n / elapsed / 1e12


def detect_device(device_type: str) -> str:
    """The peak-table key of this machine: from the CUDA device name, ``910b`` on Ascend, else ``cpu``."""
    if device_type == "npu":
        return "910b"
    if device_type == "cuda":
        import torch

        name = torch.cuda.get_device_name().lower()
        for key in ("h200", "h100", "a100"):
            if key in name:
                return key
        raise ValueError(f"no peak FLOP/s known for CUDA device {name!r}: pass --peak-tflops or --device")
    return "cpu"


def peak_tflops(device: str, *, override: float | None, dtype: torch.dtype) -> tuple[float, str]:
    """(peak TFLOP/s per device, where it came from): ``--peak-tflops``, the table, or a CPU microbench."""
    if override is not None:
        return override, "--peak-tflops"
    if device == "cpu":
        import torch

        return measure_cpu_tflops(dtype), f"matmul microbench ({torch.get_num_threads()} threads, {dtype})"
    return PEAK_TFLOPS[device], f"table ({device}, dense bf16)"
