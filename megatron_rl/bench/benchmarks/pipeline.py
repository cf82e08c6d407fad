"""Periodic asynchrony vs the synchronous loop on the same small RL workload, in one run.

    python -m megatron_rl bench pipeline

A small random Llama (char tokenizer, ``megatron_rl.models.synthetic``) trained with GRPO on
reasoning_gym arithmetic prompts; the hf engine runs in its own process pinned to core 1,
the trainer is pinned to core 0 (as they would own separate devices). Both modes run the same
steps from the same weights (``--steps``, the first ``--warmup`` not timed), alternating
sync and periodic runs ``--rounds`` times so machine noise hits both alike. Per step, from
the sync run: ``gen_s`` is the consumer's wait for the whole batch (generation + scoring),
``train_s`` the trainer's forward/backward and optimizer time, ``weight_sync_s`` the snapshot
+ engine reload (neither mode can overlap it: DESIGN §1, periodic = T_gen + T_train(last
groups) + T_sync). Prints one JSON line: ``{"sync_s", "periodic_s", "gen_s", "train_s",
"overlap_efficiency", ...}`` with overlap_efficiency = (sync_s - periodic_s) / min(gen_s, train_s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: steps, rounds, workload and model size, the two pinned cores."""
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2, help="sync/periodic pairs, interleaved (noise)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--trainer-core", type=int, default=0)
    p.add_argument("--engine-core", type=int, default=1)


def run_config(args, model: Path, mode: str) -> dict:
    """The RL run's config (as a dict) in pipeline ``mode``."""
    return {
        "model": {"hf_path": str(model), "dtype": "float32"},
        "attention": {"backend": "split"},
        "algorithm": {"loss": "grpo"},
        "rollout": {
            "engine": "hf",
            "num_engines": 1,
            "devices": [f"cpu:{args.engine_core}"],
            "max_batch_size": args.group_size,  # one group per decode batch: groups finish one by one
            "sampling": {"temperature": 1.0, "max_new_tokens": args.max_new_tokens, "seed": 0},
        },
        "pipeline": {"mode": mode, "micro_batch_tokens": 4096},
        "control": {"kind": "fixed", "group_size": args.group_size},
        "data": {"source": "reasoning_gym:basic_arithmetic", "size": 256, "seed": 0, "chat_template": False},
        "reward": {"fn": "exact_match"},
        "trainer": {"steps": args.steps, "prompts_per_batch": args.prompts, "lr": 1e-4, "seed": 0},
    }


def _step_times(args) -> dict[str, list[dict]]:
    """The measured steps' metrics of ``--rounds`` sync and periodic runs each, by mode."""
    from megatron_rl.config import config_from_dict
    from megatron_rl.models.synthetic import write_char_llama
    from megatron_rl.trainer.loop import train

    times: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_char_llama(
            Path(tmp) / "model",
            hidden=args.hidden,
            layers=args.layers,
            heads=args.hidden // 64,
            kv_heads=args.hidden // 64,
        )
        for _ in range(args.rounds):
            for mode in ("sync", "periodic"):
                history = train(config_from_dict(run_config(args, model, mode)), platform="cpu")
                times.setdefault(mode, []).extend(history[args.warmup :])
    return times


def run(args: argparse.Namespace) -> dict:
    """Alternate sync and periodic runs; mean step times and the overlap efficiency."""
    os.sched_setaffinity(0, {args.trainer_core})
    import torch

    torch.set_num_threads(1)
    times = _step_times(args)

    def mean(mode: str, key: str) -> float:
        return statistics.mean(h[key] for h in times[mode])

    sync_s, periodic_s = mean("sync", "time/step_s"), mean("periodic", "time/step_s")
    gen_s, train_s = mean("sync", "time/queue_wait_s"), mean("sync", "time/train_s")
    return {
        "sync_s": round(sync_s, 3),
        "periodic_s": round(periodic_s, 3),
        "gen_s": round(gen_s, 3),
        "train_s": round(train_s, 3),
        "weight_sync_s": round(mean("sync", "time/weight_sync_s"), 3),
        "overlap_efficiency": round((sync_s - periodic_s) / min(gen_s, train_s), 3),
        "steps_timed": len(times["sync"]),
        "rounds": args.rounds,
        "prompts": args.prompts,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "model": {"hidden": args.hidden, "layers": args.layers},
        "cores": {"trainer": args.trainer_core, "engine": args.engine_core},
    }
