"""Time one tri-model micro-step against three separate passes, and the two proximal modes.

    python -m megatron_rl bench trimodel [--model <hf dir>] [--pp 2] [--tp 1]

Starts its own ``tp * pp`` ranks (torchrun; gloo on CPU), builds policy / old / ref (random
tiny Qwen3-like decoders, or ``--model`` loaded three times) and packs random groups into
micro-batches. Measured side by side in one run, alternating, median of ``--repeats``:

- ``fused_s``: ``TriModel.run`` — ONE schedule, forward + backward of the policy, old and
  ref log-probs without grad;
- ``separate_s``: the same work as three schedules (policy forward + backward, old
  forward-only, ref forward-only) on the same micro-batches;
- ``prox_loglinear_s``: A-3PO's ``loglinear_proximal_logp`` over the same micro-batches'
  response tokens (no forward); ``prox_recompute_s``: the old-policy forward-only schedule
  that ``proximal: recompute`` needs instead.

Times are per micro-step, the slowest rank's. Rank 0 prints one JSON line:
``{"fused_s", "separate_s", "ratio" (fused / separate), "prox_loglinear_s", "prox_recompute_s", …config}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from megatron_rl.bench.benchmarks import relaunch_command


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: model, parallel layout, micro-batch shape, backend, repeats."""
    p.add_argument("--model", default=None, help="local HF checkpoint dir; default: a random tiny decoder")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--layers", type=int, default=4, help="tiny decoder only")
    p.add_argument("--hidden", type=int, default=256, help="tiny decoder only")
    p.add_argument("--groups", type=int, default=4, help="prompt groups per micro-step")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt (K)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--token-budget", type=int, default=384, help="packed tokens per micro-batch")
    p.add_argument("--attention-backend", default="split")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict | None:
    """Outside torchrun: start ``tp * pp`` ranks of this benchmark (rank 0 prints); inside: one rank."""
    if "LOCAL_RANK" in os.environ:
        return worker(args)
    cmd = relaunch_command("trimodel", args.argv, args.tp * args.pp)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1")
    if rc := subprocess.run(cmd, env=env).returncode:
        raise SystemExit(rc)
    return None


def _models(args, tp: int, pp: int):
    """(policy, old, ref) stages and the real vocabulary size."""
    from megatron_rl.models import DecoderSpec, build_gpt_model, load_model_from_hf

    if args.model:
        loaded = [load_model_from_hf(args.model, attention_backend=args.attention_backend) for _ in range(3)]
        return [m for m, _ in loaded], loaded[0][1].vocab_size
    heads = max(args.hidden // 64, 2)
    spec = DecoderSpec(
        model_type="qwen3",
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=2 * args.hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=args.hidden // heads,
        vocab_size=1000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        qkv_bias=False,
        qk_norm=True,
        tie_word_embeddings=False,
    )
    return [build_gpt_model(spec, tp=tp, pp=pp, attention_backend=args.attention_backend) for _ in range(3)], 1000


def _micro_batches(args, vocab: int):
    """``--groups`` random groups packed into micro-batches of ``--token-budget`` tokens."""
    import torch

    from megatron_rl.attention.packing import TokenGroup, pack_groups

    g = torch.Generator().manual_seed(args.seed)
    groups = [
        TokenGroup(
            prompt_ids=torch.randint(0, vocab, (args.prompt_len,), generator=g),
            response_ids=tuple(
                torch.randint(0, vocab, (args.response_len,), generator=g) for _ in range(args.group_size)
            ),
        )
        for _ in range(args.groups)
    ]
    return pack_groups(groups, token_budget=args.token_budget)


def _timed(fn, sync) -> float:
    """Wall time of ``fn()`` between barriers, the slowest rank's."""
    import torch
    import torch.distributed as dist

    sync()
    start = time.perf_counter()
    fn()
    sync()
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _separate_step(models, mbs, vocab: int, *, train_first: bool) -> None:
    """One schedule per model: the first forward + backward if ``train_first``, the rest forward-only."""
    from megatron_rl.attention.context import packed_attention
    from megatron_rl.parallel.schedule import run_schedule
    from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs

    def forward_step(model, mb):
        with packed_attention(mb.layout):
            return model(mb.token_ids[None], mb.position_ids[None], attention_mask=None)

    def loss(logits, mb):
        lp = vocab_parallel_logprobs(logits[0, mb.logit_index], mb.target_ids, vocab_size=vocab)
        return lp.sum(), lp.detach()

    for k, model in enumerate(models):
        run_schedule(
            model,
            mbs,
            forward_step=forward_step,
            loss=loss,
            seq_length=lambda mb: mb.num_tokens,
            forward_only=k > 0 or not train_first,
        )


def _loglinear_inputs(mbs) -> list[tuple]:
    """Per micro-batch (behav_logp, logp, versions, mask), padded ``[R, L]`` as the loss sees them."""
    import torch

    from megatron_rl.attention.packing import unpack_logprobs_padded

    out = []
    for mb in mbs:
        logp, mask = unpack_logprobs_padded(torch.randn(mb.target_ids.numel()), mb)
        out.append((logp - 0.01, logp, torch.full_like(logp, 3, dtype=torch.int64), mask))
    return out


def _loglinear_step(inputs: list[tuple]) -> None:
    """A-3PO proximal log-probs for every micro-batch (no forward)."""
    from megatron_rl.algorithms import loglinear_proximal_logp

    for behav, logp, versions, mask in inputs:
        loglinear_proximal_logp(behav, logp, versions, 5, mask)


def worker(args: argparse.Namespace) -> dict | None:
    """One rank: alternate fused / separate micro-steps and the two proximal modes; rank 0's report."""
    import torch
    import torch.distributed as dist

    from megatron_rl.algorithms import LossSettings
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trimodel import LogprobSettings, TriModel, plan_trimodel

    initialize_parallel(tp=args.tp, pp=args.pp, seed=args.seed)
    (policy, old, ref), vocab = _models(args, args.tp, args.pp)
    mbs = _micro_batches(args, vocab)
    prox_inputs = _loglinear_inputs(mbs)
    plan = plan_trimodel(LossSettings(kl_coef=0.1), optimizer_steps_per_batch=2)  # all three resident
    tri = TriModel(policy=policy, old=old, ref=ref, plan=plan, logprobs=LogprobSettings(vocab_size=vocab))

    def fused():
        tri.run(mbs, loss=lambda lp, i: (lp.policy.sum(), None))

    steps = {
        "fused_s": fused,
        "separate_s": lambda: _separate_step([policy, old, ref], mbs, vocab, train_first=True),
        "prox_loglinear_s": lambda: _loglinear_step(prox_inputs),
        "prox_recompute_s": lambda: _separate_step([old], mbs, vocab, train_first=False),
    }
    times = _median_times(steps, args.repeats, policy)
    out = None
    if dist.get_rank() == 0:
        out = {**times, "ratio": times["fused_s"] / times["separate_s"]}
        out.update(
            tp=args.tp,
            pp=args.pp,
            micro_batches=len(mbs),
            tokens=sum(mb.num_tokens for mb in mbs),
            response_tokens=sum(mb.target_ids.numel() for mb in mbs),
            repeats=args.repeats,
            model=args.model or f"random qwen3 {args.layers}x{args.hidden}",
            threads=torch.get_num_threads(),
        )
    dist.barrier()
    return out


def _median_times(steps: dict, repeats: int, policy) -> dict[str, float]:
    """Median seconds of each step over ``repeats`` rounds (a first warm-up round is dropped)."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {k: [] for k in steps}
    for rep in range(repeats + 1):
        for key, fn in steps.items():
            policy.zero_grad(set_to_none=True)
            t = _timed(fn, dist.barrier)
            if rep:
                times[key].append(t)
    return {k: statistics.median(v) for k, v in times.items()}
