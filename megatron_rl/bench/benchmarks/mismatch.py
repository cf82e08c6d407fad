"""Measure the training–inference mismatch of a rollout engine after one weight sync.

    python -m megatron_rl bench mismatch --engine hf|vllm --engine-dtype float32|bfloat16 [--model DIR | --tiny]

Builds the trainer's megatron model (fp32, TP = PP = 1) from the checkpoint, nudges its weights
(``--perturb``, so that only a real sync can make the engine agree), hands them to a rollout
engine of the chosen backend and dtype once (a HF snapshot, as the training loop does), samples
``--groups`` groups of ``--group-size`` responses, recomputes every sampled token's log-prob
with the trainer model at the sampling temperature, and prints one JSON line: the
``mismatch/…`` metrics of ``algorithms.correction`` and the fraction TRL's default correction
(sequence_mask, C_max = 3) would drop, plus the settings. ``--skip-sync`` leaves the engine on
the checkpoint's weights (what an unsynced engine looks like to the alarm).

Default model: ``.cache/models/smollm2-135m-instruct`` (``python tools/prepare_model.py``);
``--tiny`` writes a tiny random Llama with a character tokenizer instead (seconds on a CPU).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import get_args

PROMPTS = (
    "What is 17 + 25? Answer with a number.",
    "Name a primary colour.",
    "Write the next number: 2, 4, 8, 16,",
    "Translate 'good morning' to French.",
    "How many legs does a spider have?",
    "Complete: The capital of Italy is",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: engine and dtype, model, sampling, perturbation, sync or not."""
    from megatron_rl.config.schema import DType, EngineName

    p.add_argument("--engine", choices=get_args(EngineName), default="hf")
    p.add_argument("--engine-dtype", choices=get_args(DType), default="float32")
    p.add_argument("--model", default=".cache/models/smollm2-135m-instruct", help="local HF checkpoint directory")
    p.add_argument("--tiny", action="store_true", help="use a tiny random Llama (char tokenizer) instead")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--perturb", type=float, default=1e-2, help="relative noise added to the trainer's weights")
    p.add_argument("--skip-sync", action="store_true", help="do not hand the weights to the engine")
    p.add_argument("--seed", type=int, default=0)


def _perturb(model, scale: float, seed: int) -> None:
    """w ← w · (1 + scale · ε), ε ~ N(0, 1): a stand-in for an optimizer step."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + scale * torch.randn(p.shape, generator=g).to(p.device, p.dtype))


def _trainer_logprobs(model, spec, results, temperature: float):
    """Padded ``[B, L]`` trainer log-probs of each result's response tokens, and the mask."""
    import torch

    from megatron_rl.parallel.inference import forward_logprobs

    width = max(len(r.response_ids) for r in results)
    logp, mask = torch.zeros(len(results), width), torch.zeros(len(results), width)
    for i, r in enumerate(results):
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        lp = forward_logprobs(model, ids, vocab_size=spec.vocab_size, temperature=temperature or 1.0)
        n = len(r.response_ids)
        logp[i, :n], mask[i, :n] = lp[0, len(r.prompt_ids) - 1 :], 1.0
    return logp, mask


def _model_dir(args: argparse.Namespace, work: Path) -> Path:
    """The checkpoint to measure: a tiny random one (``--tiny``) or ``--model``."""
    if args.tiny:
        from megatron_rl.models.synthetic import write_char_llama

        return write_char_llama(work / "tiny", hidden=64, layers=2, heads=2, kv_heads=2, seed=args.seed)
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"no checkpoint at {args.model}: run `python tools/prepare_model.py`, or pass --tiny")
    return Path(args.model)


def _requests(args: argparse.Namespace, model_dir: Path) -> list:
    """``--groups`` x ``--group-size`` seeded sampling requests over the fixed prompts."""
    from transformers import AutoTokenizer

    from megatron_rl.rollout import GenerationRequest, SamplingSettings

    tok = AutoTokenizer.from_pretrained(model_dir)
    stop = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
    return [
        GenerationRequest(
            request_id=f"{g}/{k}",
            prompt_ids=tuple(tok.encode(PROMPTS[g % len(PROMPTS)])),
            sampling=SamplingSettings(
                temperature=args.temperature,
                top_p=args.top_p,
                stop_token_ids=stop,
                max_new_tokens=args.max_new_tokens,
                seed=args.seed * 1000 + g * 100 + k,
            ),
        )
        for g in range(args.groups)
        for k in range(args.group_size)
    ]


def _generate(args: argparse.Namespace, model_dir: Path, work: Path):
    """Sync the (perturbed) trainer model into a fresh engine and sample; (model, spec, results, sync_s)."""
    import torch

    from megatron_rl.config.schema import SamplingConfig
    from megatron_rl.models import load_model_from_hf, save_hf_checkpoint
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.rollout import EngineSettings, build_engine
    from megatron_rl.weight_sync.snapshot import SnapshotUpdate

    # The engine first: its worker processes must not inherit this process's rendezvous variables.
    engine = build_engine(
        EngineSettings(
            engine=args.engine,
            model_path=str(model_dir),
            dtype=args.engine_dtype,
            sampling=SamplingConfig(seed=args.seed),
        )
    )
    try:
        initialize_parallel(tp=1, pp=1, seed=args.seed, platform="cpu")
        model, spec = load_model_from_hf(model_dir, params_dtype=torch.float32)
        model.eval()
        _perturb(model, args.perturb, args.seed)
        start = time.perf_counter()
        if not args.skip_sync:
            save_hf_checkpoint(model, spec, work / "v1", source_dir=model_dir)
            engine.load_weights(SnapshotUpdate(str(work / "v1")), 1)
        sync_s = time.perf_counter() - start
        results = sorted(engine.generate(_requests(args, model_dir)), key=lambda r: r.request_id)
    finally:
        engine.shutdown()
    return model, spec, results, sync_s


def run(args: argparse.Namespace) -> dict:
    """The mismatch metrics of the engine's samples against the trainer's log-probs, as one dict."""
    import torch

    from megatron_rl.algorithms import RolloutCorrection, rollout_correction
    from megatron_rl.parallel.state import destroy_parallel

    work = Path(tempfile.mkdtemp(prefix="bench_mismatch_"))
    model_dir = _model_dir(args, work)
    model, spec, results, sync_s = _generate(args, model_dir, work)
    logp, mask = _trainer_logprobs(model, spec, results, args.temperature)
    behav = torch.zeros_like(logp)
    for i, r in enumerate(results):
        behav[i, : len(r.logprobs)] = torch.tensor(r.logprobs)
    trl_default = RolloutCorrection(mode="sequence_mask", c_max=3.0)
    corr = rollout_correction(
        trl_default, trainer_logp=logp, behav_logp=behav, logp=logp, advantages=torch.zeros(len(results)), mask=mask
    )
    destroy_parallel()
    return {
        **corr.metrics.to_log(),
        "engine": args.engine,
        "engine_dtype": args.engine_dtype,
        "trainer_dtype": "float32",
        "model": "tiny" if args.tiny else str(model_dir),
        "synced": not args.skip_sync,
        "weight_version": results[0].weight_version,
        "tokens": int(mask.sum()),
        "sequences": len(results),
        "temperature": args.temperature,
        "top_p": args.top_p,
        "perturb": args.perturb,
        "sync_s": round(sync_s, 3),
    }
