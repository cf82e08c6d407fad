"""Shared-prompt packing vs the K-copies layout: one forward+backward micro-step, side by side.

    python -m megatron_rl bench shared_prompt --lp 1024 --lr 128 --k 8

Same tiny megatron model, same tokens. K copies: a ``[K, Lp + Lr]`` batch, causal attention
(SDPA). Packed: ``[prompt, r_1..r_K]`` once, shared-prompt attention (``--backend``, split on
CPU). Each step computes response-token log-probs, a loss, and backward. Timings are medians
of interleaved repetitions. Prints one JSON line:
``{"lp", "lr", "k", "tokens_ratio", "attn_flops_ratio", "time_ratio", "backend", ...}``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: group shape, backend, model size, repeats, threads."""
    p.add_argument("--lp", type=int, default=1024, help="prompt length")
    p.add_argument("--lr", type=int, default=128, help="response length (each of K)")
    p.add_argument("--k", type=int, default=8, help="responses per prompt")
    p.add_argument("--backend", default="split")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: per-core cost, least noisy)")


def tiny_checkpoint(args, path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.lp + args.lr + 8,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def attention_flops_ratio(lp: int, lr: int, k: int) -> float:
    """Query-key pairs (causal) of K copies over packed: K(Lp+Lr)^2/2 vs Lp^2/2 + K*Lr*(Lp + Lr/2)."""
    copies = k * (lp + lr) ** 2 / 2
    packed = lp**2 / 2 + k * lr * (lp + lr / 2)
    return copies / packed


def _steps(args, model, spec):
    """(packed step, K-copies step, packed micro-batch, copies tensor): one forward + backward of
    the same group, shared-prompt packed vs K full copies."""
    from megatron_rl.attention.context import packed_attention
    from megatron_rl.attention.packing import TokenGroup, pack_groups
    from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab, (args.lp,), generator=g)
    responses = [torch.randint(0, args.vocab, (args.lr,), generator=g) for _ in range(args.k)]
    (mb,) = pack_groups([TokenGroup(prompt_ids=prompt, response_ids=tuple(responses))], token_budget=10**9)
    copies = torch.stack([torch.cat([prompt, r]) for r in responses])  # [K, Lp + Lr]

    def packed_step():
        with packed_attention(mb.layout):
            logits = model(mb.token_ids[None], mb.position_ids[None], attention_mask=None)
        lp = vocab_parallel_logprobs(logits[0, mb.logit_index], mb.target_ids, vocab_size=spec.vocab_size)
        lp.sum().backward()

    def copies_step():
        pos = torch.arange(copies.shape[1]).expand_as(copies)
        logits = model(copies, pos, attention_mask=None)
        lp = vocab_parallel_logprobs(logits[:, args.lp - 1 : -1], copies[:, args.lp :], vocab_size=spec.vocab_size)
        lp.sum().backward()

    return packed_step, copies_step, mb, copies


def _median_times(model, steps: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each step after one warm-up call (plans, allocator)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()
    for _ in range(repeats):
        for name, step in steps.items():
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def run(args: argparse.Namespace) -> dict:
    """Time one micro-step packed and as K copies; their ratios and the model's shape."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel

    initialize_parallel(tp=1, pp=1)
    with tempfile.TemporaryDirectory() as tmp:
        model, spec = load_model_from_hf(tiny_checkpoint(args, Path(tmp) / "model"), attention_backend=args.backend)
    packed_step, copies_step, mb, copies = _steps(args, model, spec)
    median = _median_times(model, {"packed": packed_step, "copies": copies_step}, args.repeats)
    packed_s, copies_s = median["packed"], median["copies"]
    tokens_ratio = copies.numel() / mb.num_tokens
    return {
        "lp": args.lp,
        "lr": args.lr,
        "k": args.k,
        "tokens_ratio": round(tokens_ratio, 3),
        "attn_flops_ratio": round(attention_flops_ratio(args.lp, args.lr, args.k), 3),
        "time_ratio": round(copies_s / packed_s, 3),
        "time_ratio_over_tokens_ratio": round(copies_s / packed_s / tokens_ratio, 3),
        "backend": args.backend,
        "k_copies_s": round(copies_s, 4),
        "packed_s": round(packed_s, 4),
        "threads": torch.get_num_threads(),
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "vocab": args.vocab},
    }
