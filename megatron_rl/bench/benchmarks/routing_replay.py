"""Engine / trainer mismatch of an MoE policy with and without routing replay, side by side.

    python -m megatron_rl bench routing_replay                  # a tiny random Qwen3-MoE (char tokenizer)
    python -m megatron_rl bench routing_replay --model <hf MoE dir> --router-noise 0 0.05

The ``hf`` engine samples in ``--engine-dtype`` (bf16) from a copy of the checkpoint whose
routers carry planted noise (``--router-noise``: Gaussian, relative to each router weight's
std; 0 = the same weights) and records each token's experts; the trainer (megatron-core, fp32,
the clean checkpoint) scores the same tokens once letting its routers choose
(``routing_replay: none``) and once replaying the engine's routes (``rollout``). Printed: one
JSON line, one entry per (noise, replay) with the trainer's ``mismatch/*`` metrics (the
project's ``mismatch_metrics``, what training logs) and ``routes/agree_fraction``: the share of
(token, MoE layer) pairs whose expert set the trainer's routers chose equal to the engine's.
Runs as one torchrun rank (started by the script itself).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from megatron_rl.bench.benchmarks import relaunch_command


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: model, router noise levels, engine dtype, workload shape."""
    p.add_argument("--model", help="local HF MoE checkpoint (default: write a tiny random Qwen3-MoE)")
    p.add_argument("--router-noise", type=float, nargs="+", default=[0.0, 0.1])
    p.add_argument("--engine-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)


def perturbed_copy(model: str, out: Path, noise: float, seed: int) -> Path:
    """``model`` saved to ``out`` with ``noise`` x std Gaussian noise on every router weight."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rl.rollout.backends.hf_routes import moe_routers

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in moe_routers(hf).values():
            w = router.weight
            w.add_(noise * w.std() * torch.randn(w.shape, generator=g))
    hf.save_pretrained(out)
    return out


def sample_groups(engine_dir: Path, args: argparse.Namespace, vocab: int):
    """One ``ScoredGroup`` per prompt, sampled by an in-process ``hf`` engine with route recording."""
    from megatron_rl.rollout.backends.hf import HFBackend
    from megatron_rl.rollout.settings import DeviceAssignment
    from megatron_rl.rollout.worker import WorkerSpec

    spec = WorkerSpec(
        index=0,
        backend="hf",
        model_path=str(engine_dir),
        device=DeviceAssignment(kind="cpu"),
        dtype=args.engine_dtype,
        return_routed_experts=True,
    )
    results = {r.request_id: r for r in HFBackend(spec).generate(_requests(args, vocab), weight_version=0)}
    return [_group(p, [results[f"0/{p}/{k}"] for k in range(args.group_size)]) for p in range(args.prompts)]


def _requests(args: argparse.Namespace, vocab: int) -> list:
    """``--prompts`` random prompts x ``--group-size`` seeded requests, ids ``0/<prompt>/<k>``."""
    import torch

    from megatron_rl.rollout.types import GenerationRequest, SamplingSettings

    g = torch.Generator().manual_seed(args.seed)
    prompts = [tuple(torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()) for _ in range(args.prompts)]
    return [
        GenerationRequest(
            request_id=f"0/{p}/{k}",
            prompt_ids=prompts[p],
            sampling=SamplingSettings(max_new_tokens=args.max_new_tokens, seed=p * 100 + k),
        )
        for p in range(args.prompts)
        for k in range(args.group_size)
    ]


def _group(p: int, samples: list):
    """Prompt ``p``'s engine results as a kept ``ScoredGroup`` (zero rewards and advantages)."""
    import torch

    from megatron_rl.pipeline.records import Sample, ScoredGroup

    return ScoredGroup(
        step=0,
        prompt_index=p,
        prompt_id=str(p),
        kept=True,
        rewards=torch.zeros(len(samples)),
        advantages=torch.zeros(len(samples)),
        samples=tuple(
            Sample(
                prompt_id=str(p),
                request_id=r.request_id,
                index=k,
                prompt_ids=r.prompt_ids,
                response_ids=r.response_ids,
                behav_logprobs=r.logprobs,
                weight_version=0,
                finish_reason=r.finish_reason,
                reward=0.0,
                routed_experts=r.routed_experts,
            )
            for k, r in enumerate(samples)
        ),
    )


def score(policy, groups, vocab: int, replay: bool) -> dict[str, float]:
    """The trainer's mismatch metrics over ``groups`` and its route agreement with the engine."""

    from megatron_rl.algorithms.correction import mismatch_metrics
    from megatron_rl.algorithms.losses import LossSettings
    from megatron_rl.attention.packing import pad_responses, response_mask
    from megatron_rl.pipeline.records import make_micro_batch
    from megatron_rl.trimodel import LogprobSettings, TriModel, plan_trimodel
    from megatron_rl.trimodel.routing import RouteCapture, moe_layer_numbers

    plan = plan_trimodel(LossSettings(), optimizer_steps_per_batch=1, offload_old=False, offload_ref=False)
    tri = TriModel(
        policy=policy, old=None, ref=None, plan=plan, logprobs=LogprobSettings(vocab_size=vocab, routing_replay=replay)
    )
    capture, merged, agree, pairs = RouteCapture(policy), None, 0, 0
    columns = [n - 1 for n in moe_layer_numbers(policy.config)]
    for group in groups:
        mb = make_micro_batch([group], policy_version=0)
        (lp,) = tri.run([mb.packed], loss=lambda out, _i: (out.policy.sum(), out.policy.detach()), forward_only=True)
        mask = response_mask(mb.packed, max(mb.packed.response_lens), lp.device)
        m = mismatch_metrics(pad_responses(lp, mb.packed), pad_responses(mb.behav_logprobs, mb.packed), mask)
        merged = m if merged is None else merged.merge(m)
        used = capture.routes()  # [T, L_moe, K] ascending
        engine = mb.packed.routed_experts[:, columns].long().sort(-1).values
        same = (used == engine).all(-1)[forwarded(mb.packed)]
        agree, pairs = agree + int(same.sum()), pairs + same.numel()
    capture.close()
    return merged.to_log() | {"routes/agree_fraction": agree / pairs}


def forwarded(packed):
    """``[T]`` bool: the packed tokens the engine forwarded (each response's last token was only
    sampled: its route is a copy of its predecessor's, not the engine's choice)."""
    import torch

    keep = torch.ones(packed.num_tokens, dtype=torch.bool)
    ends = packed.layout.cu_seqlens[1:].long() - 1  # every segment's last position
    keep[ends[packed.segment_ids[ends] > 0]] = False  # responses only (segment 0 is a prompt)
    return keep


def worker(args: argparse.Namespace) -> dict:
    """The single rank: sample, score with and without replay per noise level; the report."""
    import torch

    from megatron_rl.models import load_model_from_hf
    from megatron_rl.models.synthetic import write_char_moe
    from megatron_rl.parallel.state import initialize_parallel

    initialize_parallel(tp=1, pp=1, seed=args.seed, platform="cpu")
    with tempfile.TemporaryDirectory(prefix="routing-replay-") as tmp:
        model = args.model or str(write_char_moe(Path(tmp) / "model", seed=args.seed))
        policy, spec = load_model_from_hf(model, params_dtype=torch.float32, attention_backend="split")
        policy.eval()
        rows = []
        for noise in args.router_noise:
            engine_dir = perturbed_copy(model, Path(tmp) / f"engine-{noise}", noise, args.seed) if noise else model
            groups = sample_groups(Path(engine_dir), args, spec.vocab_size)
            for replay in (False, True):
                rows.append(
                    {
                        "router_noise": noise,
                        "routing_replay": "rollout" if replay else "none",
                        **score(policy, groups, spec.vocab_size, replay),
                    }
                )
    return {
        "model": args.model or "tiny random Qwen3-MoE (char tokenizer)",
        "engine_dtype": args.engine_dtype,
        "trainer_dtype": "float32",
        "results": rows,
    }


def run(args: argparse.Namespace) -> dict | None:
    """Outside torchrun: start this benchmark as one torchrun rank (it prints); inside: the rank."""
    if "LOCAL_RANK" in os.environ:
        return worker(args)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1")
    if rc := subprocess.run(relaunch_command("routing_replay", args.argv, 1), env=env).returncode:
        raise SystemExit(rc)
    return None
