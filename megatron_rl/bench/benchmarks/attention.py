"""Shared-prompt attention backends: error against the reference and speed against per-sample
attention on the same useful work. One JSON line.

    python -m megatron_rl bench attention                 # CUDA: triton + flex, bf16, a realistic shape
    python -m megatron_rl bench attention --device cpu    # tiny, Triton under TRITON_INTERPRET=1 (tests)

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
import math
import os
from dataclasses import asdict, dataclass

import torch

from megatron_rl.bench.attention import (
    Attn,
    Inputs,
    Shape,
    flash_varlen,
    fwd_bwd,
    make_inputs,
    max_errors,
    per_sample_sdpa,
    reference,
    sample_index,
    timed_ms,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: device, shape, dtype, block, repeats (unset: the device's default)."""
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


def _defaults(args: argparse.Namespace, cuda: bool) -> tuple[Shape, torch.dtype, int, int]:
    big = dict(groups=8, lp=1024, lr=512, k=8, hq=16, hkv=4, d=128, dtype="bfloat16", block=64, repeats=20)
    tiny = dict(groups=2, lp=12, lr=6, k=3, hq=2, hkv=1, d=32, dtype="float32", block=16, repeats=1)
    pick = {
        name: getattr(args, name) if getattr(args, name) is not None else value
        for name, value in (big if cuda else tiny).items()
    }
    shape = Shape(**{f: pick[f] for f in ("groups", "lp", "lr", "k", "hq", "hkv", "d")})
    return shape, getattr(torch, pick["dtype"]), pick["block"], pick["repeats"]


def backends(device: torch.device, block: int) -> dict[str, Attn | str]:
    """The shared-prompt backends to check; a string says why one is skipped."""
    from megatron_rl.attention.flex import flex_attention_packed
    from megatron_rl.attention.triton_backend import triton_attention

    out: dict[str, Attn | str] = {}
    out["triton"] = lambda q, k, v, layout, scale: triton_attention(q, k, v, layout, scale, block=block)
    out["flex"] = (
        flex_attention_packed if device.type == "cuda" else "skipped: CPU FlexAttention is forward-only (torch 2.13)"
    )
    return out


def run(args: argparse.Namespace) -> dict:
    """Check and time every shared-prompt backend and the K-copies baselines; the report."""
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the triton backend, lazily)
    shape, dtype, block, repeats = _defaults(args, cuda)
    case = _Case(shape=shape, x=make_inputs(shape, dtype, device, seed=args.seed), repeats=repeats, device=device)
    report: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "interpreted": not cuda,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": asdict(shape),
        "tokens": case.layout.total_tokens,
        "block": block,
        "useful_tflop": case.useful / 1e12,
    }
    report["backends"] = _check_backends(case, backends(device, block))
    report["baselines"] = _time_baselines(case, cuda=cuda, dtype=dtype)
    return report


@dataclass(frozen=True)
class _Case:
    """One packed micro-batch to run every method on: its shape, inputs, and how to time it."""

    shape: Shape
    x: Inputs
    repeats: int
    device: torch.device

    @property
    def layout(self):
        return self.shape.layout()

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.shape.d)

    @property
    def useful(self) -> float:
        return self.shape.useful_flop()


def _check_backends(case: _Case, found: dict[str, Attn | str]) -> dict:
    """Per shared-prompt backend: max errors against the reference, fwd+bwd ms, useful TFLOP/s."""
    x, layout, scale = case.x, case.layout, case.scale
    ref_out, ref_grads = reference(case.shape, x, scale)
    out_of: dict = {}
    for name, fn in found.items():
        if isinstance(fn, str):
            out_of[name] = {"status": fn}
            continue
        attn = (lambda f: lambda a, b, c: f(a, b, c, layout, scale))(fn)
        out, grads = fwd_bwd(attn, x.q, x.k, x.v, x.w)
        errs = {f"max_err_{key}": err for key, err in max_errors(out, grads, ref_out, ref_grads).items()}
        ms = timed_ms(lambda a=attn: fwd_bwd(a, x.q, x.k, x.v, x.w), case.repeats, case.device)
        out_of[name] = {"status": "ok", **errs, "fwd_bwd_ms": ms, "tflops": case.useful / ms / 1e9}
    return out_of


def _time_baselines(case: _Case, *, cuda: bool, dtype: torch.dtype) -> dict:
    """Per K-copies baseline (per-sample SDPA, flash-attn varlen): fwd+bwd ms and useful TFLOP/s."""
    shape, x = case.shape, case.x
    index = sample_index(shape)
    w_copies = torch.randn(sum(len(i) for i in index), shape.hq, shape.d, device=case.device)
    flash = flash_varlen(index, case.scale)
    if flash is not None and (not cuda or dtype == torch.float32):
        flash = "skipped: flash-attn needs CUDA and bf16 / fp16"
    out_of: dict = {}
    for name, fn in (
        ("sdpa_per_sample", per_sample_sdpa(index, case.scale)),
        ("flash_attn_varlen", flash if flash is not None else "skipped: flash-attn is not installed"),
    ):
        if isinstance(fn, str):
            out_of[name] = {"status": fn}
            continue
        ms = timed_ms(lambda f=fn: fwd_bwd(f, x.q, x.k, x.v, w_copies), case.repeats, case.device)
        out_of[name] = {"status": "ok", "fwd_bwd_ms": ms, "tflops": case.useful / ms / 1e9}
    return out_of
