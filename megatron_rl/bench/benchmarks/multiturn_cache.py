"""Prefix caching between the turns of multi-turn rollouts: the tool example's environment run a
few turns on its vLLM engine, once with ``enable_prefix_caching`` on and once off.

For each setting: the prefix-cache hit rate (prompt tokens of all turns that vLLM served from
its cache, ``GenerationResult.cached_tokens``, over all turns' prompt tokens: the figure the
trainer logs as ``multiturn/prefix_cache_hit_rate``; first turns hit too, on the group's shared
prompt), the same over the turns after the first only, the prompt tokens the engine had to
prefill, turns, and the rollout's seconds (engine start excluded). Same seeds both times, so
both runs sample the same trajectories up to float rounding. Prints one JSON line.

    python -m megatron_rl bench multiturn_cache [--config examples/tool_calc_smollm2/config.yaml]
        [--prompts 4] [--group 4] [--block-size N] [--kv-mib 512] [key=value ...]

The ``key=value`` overrides go to the config as on ``megatron_rl train`` (e.g. the ``echo``
environment, whose every finished turn gets another: ``environment.kind=echo
'environment.options={turns: 3}'``).
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import replace

from megatron_rl.config import load_config
from megatron_rl.data.sources import read_records
from megatron_rl.environments.base import record_fields
from megatron_rl.generation import GroupStart
from megatron_rl.rollout import build_engine
from megatron_rl.rollout.engine_wrapper import StreamRecorder
from megatron_rl.trainer.from_config import engine_settings, generator, sampling_settings


def _rollout(cfg, tokenizer, records, group: int, vllm: dict) -> dict:
    """One engine with ``vllm`` options; the rollout of ``records`` x ``group`` and its figures."""
    settings = engine_settings(cfg)
    engine = build_engine(replace(settings, vllm={**settings.vllm, **vllm}))
    try:
        sampling = replace(sampling_settings(cfg, tokenizer), seed=None)
        rollout = generator(cfg, tokenizer, sampling)  # multi-turn: the config names an environment
        starts = [
            GroupStart(
                base=f"0/{r.prompt_id}",
                fields=record_fields(r, instruction=rollout.settings.instruction),
                seed=lambda k, t, p=p: 1000 * p + 10 * k + t,
            )
            for p, r in enumerate(records)
        ]
        begin = time.perf_counter()
        recorder = StreamRecorder(engine)
        trajectories = list(
            rollout.run_groups(recorder, starts, group, stop=threading.Event(), check_version=lambda *_: None)
        )
        seconds = time.perf_counter() - begin
    finally:
        engine.shutdown()
    prompt = sum(t.turn_prompt_tokens for t in trajectories)
    cached = sum(t.cached_tokens or 0 for t in trajectories)
    later = [r for rid, r in recorder.results.items() if not rid.endswith("/0")]  # turns after the first
    later_rate = sum(r.cached_tokens or 0 for r in later) / max(1, sum(len(r.prompt_ids) for r in later))
    return {
        "prefix_cache_hit_rate": round(cached / max(prompt, 1), 4),
        "later_turns": len(later),
        "later_turns_hit_rate": round(later_rate, 4),
        "turn_prompt_tokens": prompt,
        "prefilled_tokens": prompt - cached,
        "turns": sum(t.turns for t in trajectories),
        "trajectories": len(trajectories),
        "seconds": round(seconds, 2),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags: config and overrides, prompts, group size, KV cache shape."""
    parser.add_argument("--config", default="examples/tool_calc_smollm2/config.yaml")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=None, help="KV block (default: vLLM's, 128 on CPU)")
    parser.add_argument("--kv-mib", type=int, default=512, help="KV cache size (MiB)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")


def run(args: argparse.Namespace) -> dict:
    """The rollout with prefix caching on and off; both settings' figures."""
    from transformers import AutoTokenizer

    cfg = load_config(args.config, args.overrides)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    records = read_records(cfg.data.source, size=args.prompts, seed=cfg.data.seed, options=cfg.data.options).records
    figures = {
        "bench": "multiturn_prefix_cache",
        "config": args.config,
        "overrides": args.overrides,
        "environment": cfg.environment.kind,
        "prompts": len(records),
        "group": args.group,
        "block_size": args.block_size,
    }
    engine = {"kv_cache_memory_bytes": args.kv_mib << 20} | ({"block_size": args.block_size} if args.block_size else {})
    for name, on in (("cache_on", True), ("cache_off", False)):
        figures[name] = _rollout(cfg, tokenizer, records, args.group, {"enable_prefix_caching": on, **engine})
    return figures
