"""The ``attention`` check: every shared-prompt kernel the device has, through the training
dispatch (``shared_prompt_attention(..., backend=name)``), against the ``reference`` backend in
fp32 on the same values (``megatron_rl.bench.attention``), forward and q/k/v gradients, per
dtype; and TFLOP/s of useful work next to the K-copies baselines.

Kernels: ``triton`` (CUDA; CPU only under ``TRITON_INTERPRET=1``), ``flex`` (CUDA), ``npu``
(Ascend), ``split`` (pure PyTorch, any device: the CPU path and the fallback). Baselines on the
K-copies layout: per-sample SDPA (not on Ascend), flash-attn varlen (CUDA, when installed, not
fp32), ``npu_fusion_attention`` TND (Ascend). A kernel passes when each max abs error is at most
``TOLERANCE[dtype] * max(1, max |reference|)``.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import asdict

import torch

from megatron_rl.bench import attention as bench
from megatron_rl.devcheck.outcome import CheckOptions, error_record, judged

# relative to max(1, max |reference|): fp32 kernels agree to ~1e-6; bf16 inputs round P and dO
TOLERANCE = {"float32": 2e-4, "bfloat16": 3e-2}
FULL = bench.Shape(groups=4, lp=1024, lr=512, k=8, hq=16, hkv=4, d=128)  # ~17k tokens, GQA 4:1
TINY = bench.Shape(groups=2, lp=12, lr=6, k=3, hq=2, hkv=1, d=32)
KERNELS = ("triton", "flex", "npu", "split")


def kernel_skip(name: str, device: torch.device) -> str | None:
    """Why kernel ``name`` does not run on ``device`` (None: it runs)."""
    kind = device.type
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if kind == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "on the CPU only under TRITON_INTERPRET=1 (the interpreter; slow)"
        return None if kind in ("cuda", "cpu") else f"a CUDA kernel; not for {kind}"
    if name == "flex":
        return None if kind == "cuda" else "FlexAttention trains on CUDA only (CPU: forward only)"
    if name == "npu":
        return None if kind == "npu" else "npu_fusion_attention needs an Ascend device"
    return None


def baselines(device: torch.device, dtype: torch.dtype, index, scale: float) -> dict:
    """K-copies baselines on ``device``: name -> attention fn, or a string saying why not."""
    if device.type == "npu":
        return {"npu_fusion_k_copies": bench.npu_k_copies(index, scale)}
    flash = bench.flash_varlen(index, scale)
    if flash is None:
        flash = "flash-attn is not installed"
    elif device.type != "cuda" or dtype == torch.float32:
        flash = "flash-attn needs CUDA and bf16 / fp16"
    return {"sdpa_per_sample": bench.per_sample_sdpa(index, scale), "flash_attn_varlen": flash}


def settings(opts: CheckOptions, device: torch.device) -> tuple[bench.Shape, list[torch.dtype], int]:
    """Shape, dtypes and timed repeats: tiny and fp32 on cpu / emulated, full and fp32 + bf16 on devices."""
    if device.type not in ("cuda", "npu"):
        return TINY, [torch.float32], 1
    return (TINY, [torch.float32, torch.bfloat16], 2) if opts.quick else (FULL, [torch.float32, torch.bfloat16], 10)


def kernel_result(name, x, ref, shape, *, device, repeats) -> dict:
    """Errors against the reference, time and useful TFLOP/s of one kernel on one dtype."""
    from megatron_rl.attention import shared_prompt_attention

    layout, scale = shape.layout(), 1.0 / math.sqrt(shape.d)

    def attn(q, k, v):
        return shared_prompt_attention(q, k, v, layout, backend=name, softmax_scale=scale)

    out, grads = bench.fwd_bwd(attn, x.q, x.k, x.v, x.w)
    errors = bench.max_errors(out, grads, *ref)
    ref_max = {"out": ref[0].abs().max().item()}
    ref_max.update({g: t.abs().max().item() for g, t in zip(bench.GRADS, ref[1], strict=True)})
    ms = bench.timed_ms(lambda: bench.fwd_bwd(attn, x.q, x.k, x.v, x.w), repeats, device)
    return {"max_abs_err": errors, "ref_abs_max": ref_max, "fwd_bwd_ms": ms, "tflops": shape.useful_flop() / ms / 1e9}


def baseline_result(fn, x, shape, index, *, device, repeats) -> dict:
    """Time and useful TFLOP/s of one baseline (no error check: the baselines are not the subject)."""
    w = torch.randn(sum(len(i) for i in index), shape.hq, shape.d, device=device)
    ms = bench.timed_ms(lambda: bench.fwd_bwd(fn, x.q, x.k, x.v, w), repeats, device)
    return {"status": "pass", "fwd_bwd_ms": ms, "tflops": shape.useful_flop() / ms / 1e9}


def guarded(fn, *args, **kwargs) -> dict:
    """``fn(*args, **kwargs)``, or a ``fail`` with the error: one kernel's failure must not hide the next."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # recorded in the report
        return {"status": "fail", "error": error_record(exc)}


def judge_kernel(result: dict, dtype_name: str) -> list[str]:
    """The errors above tolerance, in words (empty: pass)."""
    if "error" in result:
        return [f"{result['error']['type']}: {result['error']['message'][:200]}"]
    tol = TOLERANCE[dtype_name]
    return [
        f"{g} max abs error {err:.2e} > {tol:g} x max(1, {result['ref_abs_max'][g]:.3g})"
        for g, err in result["max_abs_err"].items()
        if err > tol * max(1.0, result["ref_abs_max"][g])
    ]


def run_dtype(dtype, shape, device, repeats, reasons: list[str]) -> dict:
    """Kernels and baselines on one dtype; appends missed thresholds to ``reasons``."""
    name_of = str(dtype).removeprefix("torch.")
    x = bench.make_inputs(shape, dtype, device)
    scale, index = 1.0 / math.sqrt(shape.d), bench.sample_index(shape)
    ref = bench.reference(shape, x, scale)
    kernels, base = {}, {}
    for name in KERNELS:
        if why := kernel_skip(name, device):
            kernels[name] = {"status": "skip", "reason": why}
            continue
        result = guarded(kernel_result, name, x, ref, shape, device=device, repeats=repeats)
        missed = judge_kernel(result, name_of)
        reasons += [f"{name} {name_of}: {m}" for m in missed]
        kernels[name] = {**result, "status": "fail" if missed else "pass"}
    for name, fn in baselines(device, dtype, index, scale).items():
        base[name] = (
            {"status": "skip", "reason": fn}
            if isinstance(fn, str)
            else guarded(baseline_result, fn, x, shape, index, device=device, repeats=repeats)
        )
        if base[name]["status"] == "fail":
            reasons.append(f"baseline {name} {name_of}: {base[name]['error']['type']}")
    best = max((b["tflops"] for b in base.values() if b["status"] == "pass"), default=None)
    for k in kernels.values():
        if best and k["status"] == "pass":
            k["speedup_vs_best_baseline"] = k["tflops"] / best
    return {"tolerance": TOLERANCE[name_of], "kernels": kernels, "baselines": base}


def check_attention(opts: CheckOptions) -> dict:
    from megatron_rl.platform import setup_platform

    device = setup_platform(opts.device).device
    shape, dtypes, repeats = settings(opts, device)
    figures: dict = {
        "shape": asdict(shape),
        "tokens": shape.layout().total_tokens,
        "useful_tflop": shape.useful_flop() / 1e12,
        "repeats": repeats,
        "dtypes": {},
    }
    reasons: list[str] = []
    for dtype in dtypes:
        figures["dtypes"][str(dtype).removeprefix("torch.")] = run_dtype(dtype, shape, device, repeats, reasons)
    return judged(figures, reasons)
