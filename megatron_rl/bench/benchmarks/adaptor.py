"""Overhead of the CPU adaptor patches (platform/patches) on a megatron forward+backward.

    python -m megatron_rl bench adaptor

megatron-core cannot run unpatched on a CPU-only torch build, so there is no unpatched run to
time against. Instead this profiles forward+backward steps of a small model and attributes
the time spent inside functions defined in ``megatron_rl/platform/patches`` (the proxy's
attribute reads, redirected factories, the CPU RNG tracker's fork, ...). Prints one JSON
line: ``{"step_s", "adaptor_s", "adaptor_fraction", "adaptor_calls", "tp", "tokens"}``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import torch


def _tiny_model():
    """A 4-layer Llama (vocabulary 2048, hidden 256) loaded into megatron; (model, spec)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_rl.models import load_model_from_hf

    with tempfile.TemporaryDirectory() as tmp:
        cfg = LlamaConfig(
            vocab_size=2048,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
        LlamaForCausalLM(cfg).save_pretrained(Path(tmp) / "m")
        return load_model_from_hf(Path(tmp) / "m")


def _profile(step, steps: int) -> tuple[float, float, float]:
    """(seconds per step, seconds inside the platform patches per step, their calls per step)."""
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    total = (time.perf_counter() - t0) / steps
    stats = pstats.Stats(profiler).stats
    own = [(v[1], v[2]) for (file, _, _), v in stats.items() if "megatron_rl/platform/patches" in file]
    adaptor = sum(t for _, t in own) / steps  # tottime: time inside the patch functions themselves
    return total, adaptor, sum(n for n, _ in own) / steps


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: sequence length, batch, timed steps."""
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)


def run(args: argparse.Namespace) -> dict:
    """Profile forward+backward steps; the share of their time spent in the platform patches."""
    torch.set_num_threads(1)
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs

    initialize_parallel(tp=1, pp=1)
    model, spec = _tiny_model()
    ids = torch.randint(0, 2048, (args.batch, args.seq_len))
    pos = torch.arange(args.seq_len).expand_as(ids)

    def step():
        logits = model(ids, pos, attention_mask=None)
        vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=spec.vocab_size).sum().backward()

    step()  # warm-up: the proxy caches attributes on first access
    total, adaptor, calls = _profile(step, args.steps)
    return {
        "step_s": round(total, 4),
        "adaptor_s": round(adaptor, 6),
        "adaptor_fraction": round(adaptor / total, 6),
        "adaptor_calls": calls,
        "tp": 1,
        "tokens": ids.numel(),
    }
