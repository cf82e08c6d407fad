"""Shared-prompt attention backends: error against the reference and speed against per-sample
attention on the same useful work. One JSON line.

    python tools/bench_attention.py                     # CUDA: triton + flex, bf16, a realistic shape
    python tools/bench_attention.py --device cpu        # tiny, Triton under TRITON_INTERPRET=1 (tests)

Each backend (``megatron_rl.attention``: ``triton``, ``flex``) runs forward + backward of
``sum(out * w)`` on a packed micro-batch of ``--groups`` groups ``[prompt, r_1..r_K]``; its output
and q/k/v gradients are compared with the ``reference`` backend (dense mask, fp32, same values):
max absolute error. Timed against the K-copies layout the shared prompt avoids: per-sample SDPA
(one causal call per ``[prompt, r_i]``) and, when installed, flash-attn's varlen kernel over the
same samples. TFLOP/s are *useful* FLOPs (the shared-prompt mask's allowed pairs,
``4·Hq·D`` per pair forward, x3 with the backward) / time, so every method is credited with the
same work and the K-copies ones pay for recomputing each prompt K times.

On the CPU the Triton kernel runs under the interpreter (``TRITON_INTERPRET=1``, set here before
triton is imported; 100x slower than native, so keep shapes tiny) in fp32: bf16 ``tl.dot`` is
wrong in the interpreter (STACK-NOTES). CPU FlexAttention is forward-only and is skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--groups", type=int, default=None, help="groups per micro-batch (CUDA 8, CPU 2)")
    p.add_argument("--lp", type=int, default=None, help="prompt length (CUDA 1024, CPU 12)")
    p.add_argument("--lr", type=int, default=None, help="longest response length (CUDA 512, CPU 6)")
    p.add_argument("--k", type=int, default=None, help="responses per prompt (CUDA 8, CPU 3)")
    p.add_argument("--hq", type=int, default=None, help="query heads (CUDA 16, CPU 2)")
    p.add_argument("--hkv", type=int, default=None, help="key/value heads (CUDA 4, CPU 1)")
    p.add_argument("--d", type=int, default=None, help="head dim, a power of two (CUDA 128, CPU 32)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None, help="CUDA bf16, CPU fp32")
    p.add_argument("--block", type=int, default=None, help="triton block edge (CUDA 64, CPU 16)")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions (CUDA 20, CPU 1)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _defaults(args: argparse.Namespace, cuda: bool) -> tuple[Shape, torch.dtype, int, int]:
    big = dict(groups=8, lp=1024, lr=512, k=8, hq=16, hkv=4, d=128, dtype="bfloat16", block=64, repeats=20)
    tiny = dict(groups=2, lp=12, lr=6, k=3, hq=2, hkv=1, d=32, dtype="float32", block=16, repeats=1)
    pick = {name: getattr(args, name) if getattr(args, name) is not None else value
            for name, value in (big if cuda else tiny).items()}
    shape = Shape(**{f: pick[f] for f in ("groups", "lp", "lr", "k", "hq", "hkv", "d")})
    return shape, getattr(torch, pick["dtype"]), pick["block"], pick["repeats"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


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
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


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
        return flash_attn_varlen_func(q[f], k[f], v[f], c, c, int(lens.max()), int(lens.max()),
                                      softmax_scale=scale, causal=True)
    return run


def reference(shape: Shape, q, k, v, w, scale: float) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The ``reference`` backend in fp32 on the same values, group by group (groups never attend
    to each other, and a dense ``[T, T]`` mask of the whole micro-batch would not fit)."""
    from megatron_rl.attention import AttentionLayout
    from megatron_rl.attention.reference import reference_attention

    outs, grads, start = [], ([], [], []), 0
    for lens in shape.response_lens():
        one = AttentionLayout.from_lengths([shape.lp], [lens])
        sl = slice(start, start + one.total_tokens)
        out, g = fwd_bwd(lambda *x, lay=one: reference_attention(*x, lay, scale),
                         q[sl].float(), k[sl].float(), v[sl].float(), w[sl])
        outs.append(out)
        for acc, part in zip(grads, g, strict=True):
            acc.append(part)
        start = sl.stop
    return torch.cat(outs), tuple(torch.cat(acc) for acc in grads)


def backends(device: torch.device, block: int) -> dict[str, Attn | str]:
    """The shared-prompt backends to check; a string says why one is skipped."""
    from megatron_rl.attention.flex import flex_attention_packed
    from megatron_rl.attention.triton_backend import triton_attention

    out: dict[str, Attn | str] = {}
    out["triton"] = lambda q, k, v, layout, scale: triton_attention(q, k, v, layout, scale, block=block)
    out["flex"] = (flex_attention_packed if device.type == "cuda"
                   else "skipped: CPU FlexAttention is forward-only (torch 2.13)")
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the triton backend, lazily)
    from megatron_rl.attention import AttentionLayout

    shape, dtype, block, repeats = _defaults(args, cuda)
    torch.manual_seed(args.seed)
    layout = AttentionLayout.from_lengths([shape.lp] * shape.groups, shape.response_lens())
    t, scale = layout.total_tokens, 1.0 / math.sqrt(shape.d)
    q = torch.randn(t, shape.hq, shape.d, device=device).to(dtype)
    k, v = (torch.randn(t, shape.hkv, shape.d, device=device).to(dtype) for _ in range(2))
    w = torch.randn(t, shape.hq, shape.d, device=device)
    ref_out, ref_grads = reference(shape, q, k, v, w, scale)
    useful = 3 * 4.0 * shape.hq * shape.d * shape.attention_pairs()  # fwd (QK^T, PV) + bwd (2x)
    report: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "interpreted": not cuda,
                    "dtype": str(dtype).removeprefix("torch."), "shape": asdict(shape), "tokens": t, "block": block,
                    "useful_tflop": useful / 1e12, "backends": {}, "baselines": {}}
    for name, fn in backends(device, block).items():
        if isinstance(fn, str):
            report["backends"][name] = {"status": fn}
            continue
        attn = (lambda f: lambda a, b, c: f(a, b, c, layout, scale))(fn)
        out, grads = fwd_bwd(attn, q, k, v, w)
        errs = {"max_err_out": (out.float() - ref_out).abs().max().item()}
        errs.update({f"max_err_{g}": (got.float() - want).abs().max().item()
                     for g, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True)})
        ms = timed_ms(lambda a=attn: fwd_bwd(a, q, k, v, w), repeats, device)
        report["backends"][name] = {"status": "ok", **errs, "fwd_bwd_ms": ms, "tflops": useful / ms / 1e9}
    index = sample_index(shape)
    w_copies = torch.randn(sum(len(i) for i in index), shape.hq, shape.d, device=device)
    flash = flash_varlen(index, scale)
    if flash is not None and (not cuda or dtype == torch.float32):
        flash = "skipped: flash-attn needs CUDA and bf16 / fp16"
    for name, fn in (("sdpa_per_sample", per_sample_sdpa(index, scale)),
                     ("flash_attn_varlen", flash if flash is not None else "skipped: flash-attn is not installed")):
        if isinstance(fn, str):
            report["baselines"][name] = {"status": fn}
            continue
        ms = timed_ms(lambda f=fn: fwd_bwd(f, q, k, v, w_copies), repeats, device)
        report["baselines"][name] = {"status": "ok", "fwd_bwd_ms": ms, "tflops": useful / ms / 1e9}
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
