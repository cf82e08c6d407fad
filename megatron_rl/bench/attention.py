"""Shared-prompt attention measured against its reference and the K-copies layout it avoids.

Used by ``bench/benchmarks/attention.py`` (the benchmark) and ``tools/device_check.py`` (first run on
a device). A ``Shape`` is a packed micro-batch of ``groups`` x ``[prompt, r_1..r_K]``; every
method runs forward + backward of ``sum(out * w)``. ``reference`` is the ``reference`` backend in
fp32 on the same values; baselines attend over the K-copies layout (``[prompt, r_i]`` per sample):
per-sample SDPA, flash-attn's varlen kernel (CUDA), ``npu_fusion_attention`` TND (Ascend).
TFLOP/s are *useful* FLOPs (the shared-prompt mask's allowed pairs, ``4·Hq·D`` per pair forward,
x3 with the backward) / time, so the K-copies methods pay for recomputing each prompt K times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
GRADS = ("dq", "dk", "dv")


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The packed micro-batch: ``groups`` x (prompt ``lp``, ``k`` ragged responses around ``lr``)."""

    groups: int
    lp: int
    lr: int
    k: int
    hq: int
    hkv: int
    d: int

    def response_lens(self) -> list[list[int]]:
        """Ragged, deterministic: response i of a group is ``lr`` shortened by up to a half."""
        return [[max(1, self.lr - (i * self.lr) // (2 * self.k)) for i in range(self.k)] for _ in range(self.groups)]

    def attention_pairs(self) -> int:
        """Allowed (query, key) pairs of the shared-prompt mask."""
        p = self.lp
        return sum(p * (p + 1) // 2 + sum(r * p + r * (r + 1) // 2 for r in lens) for lens in self.response_lens())

    def useful_flop(self) -> float:
        """Forward (QK^T, PV: 4·Hq·D per allowed pair) + backward (2x the forward)."""
        return 3 * 4.0 * self.hq * self.d * self.attention_pairs()

    def layout(self):
        """The ``AttentionLayout`` of the packed micro-batch."""
        from megatron_rl.attention import AttentionLayout

        return AttentionLayout.from_lengths([self.lp] * self.groups, self.response_lens())


@dataclass(frozen=True, kw_only=True)
class Inputs:
    """Packed q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` in the dtype under test; w ``[T, Hq, D]`` fp32."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    w: torch.Tensor


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Inputs:
    """Seeded normal inputs on ``device`` (drawn on the CPU, so every device gets the same values)."""
    g = torch.Generator().manual_seed(seed)
    t = shape.layout().total_tokens
    q = torch.randn(t, shape.hq, shape.d, generator=g)
    k, v = (torch.randn(t, shape.hkv, shape.d, generator=g) for _ in range(2))
    w = torch.randn(t, shape.hq, shape.d, generator=g)
    return Inputs(q=q.to(device, dtype), k=k.to(device, dtype), v=v.to(device, dtype), w=w.to(device))


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (cuda, npu or any backend module with ``synchronize``)."""
    if device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize()


def fwd_bwd(fn: Attn, q, k, v, w) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Output and (dq, dk, dv) of ``sum(fn(q, k, v) * w)``."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    (out.float() * w).sum().backward()
    return out.detach(), tuple(x.grad for x in leaves)


def timed_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median milliseconds of ``fn`` after one warm-up call (compiles, builds block plans)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def max_errors(out, grads, ref_out, ref_grads) -> dict[str, float]:
    """Max absolute error of the output and of each gradient against the reference."""
    errs = {"out": (out.float() - ref_out).abs().max().item()}
    for g, got, want in zip(GRADS, grads, ref_grads, strict=True):
        errs[g] = (got.float() - want).abs().max().item()
    return errs


def reference(shape: Shape, x: Inputs, scale: float) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The ``reference`` backend in fp32 on the same values, group by group (groups never attend
    to each other, and a dense ``[T, T]`` mask of the whole micro-batch would not fit)."""
    from megatron_rl.attention import AttentionLayout
    from megatron_rl.attention.reference import reference_attention

    outs, grads, start = [], ([], [], []), 0
    for lens in shape.response_lens():
        one = AttentionLayout.from_lengths([shape.lp], [lens])
        sl = slice(start, start + one.total_tokens)
        out, g = fwd_bwd(
            lambda *t, lay=one: reference_attention(*t, lay, scale),
            x.q[sl].float(),
            x.k[sl].float(),
            x.v[sl].float(),
            x.w[sl],
        )
        outs.append(out)
        for acc, part in zip(grads, g, strict=True):
            acc.append(part)
        start = sl.stop
    return torch.cat(outs), tuple(torch.cat(acc) for acc in grads)


def sample_index(shape: Shape) -> list[torch.Tensor]:
    """Packed-token indices of every sample ``[prompt, r_i]`` (the K-copies layout)."""
    out, start = [], 0
    for lens in shape.response_lens():
        prompt, r = torch.arange(start, start + shape.lp), start + shape.lp
        for n in lens:
            out.append(torch.cat([prompt, torch.arange(r, r + n)]))
            r += n
        start = r
    return out


def per_sample_sdpa(index: list[torch.Tensor], scale: float) -> Attn:
    """Causal SDPA on every ``[prompt, r_i]`` separately; output ``[Σ L_i, Hq, D]``."""

    def run(q, k, v):
        outs = []
        for idx in index:
            idx = idx.to(q.device)
            qh, kh, vh = (x[idx].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
            outs.append(o.squeeze(0).transpose(0, 1))
        return torch.cat(outs)

    return run


def flash_varlen(index: list[torch.Tensor], scale: float) -> Attn | None:
    """flash-attn's varlen kernel over the samples (causal), or None when it is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    lens = torch.tensor([len(i) for i in index])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    flat = torch.cat(index)

    def run(q, k, v):
        c, f = cu.to(q.device), flat.to(q.device)
        return flash_attn_varlen_func(
            q[f], k[f], v[f], c, c, int(lens.max()), int(lens.max()), softmax_scale=scale, causal=True
        )

    return run


def npu_k_copies(index: list[torch.Tensor], scale: float) -> Attn:
    """``npu_fusion_attention`` TND over the samples, one causal sequence each (the call the
    ``npu`` backend makes, built by ``megatron_rl_kernels.npu_args`` for prompt-only groups)."""
    from megatron_rl_kernels.npu_args import build_npu_fusion_args, npu_fusion_call

    flat, lens = torch.cat(index), [len(i) for i in index]
    cache: dict = {}

    def run(q, k, v):
        import torch_npu

        if q.device not in cache:
            cache[q.device] = (flat.to(q.device), build_npu_fusion_args(lens, [[] for _ in lens], q.device))
        f, fa = cache[q.device]
        call = npu_fusion_call(q[f], k[f], v[f], fa, scale)
        return torch_npu.npu_fusion_attention(*call.args, **call.kwargs)[0]

    return run
