"""End-to-end throughput of the demo workload: megatron_rl variants and TRL, side by side, one run.

    python -m megatron_rl bench throughput [--config examples/demo/config.yaml] [--steps 4] [--only a,b]

Each variant is a fresh process on the same machine, one after another: megatron_rl's
``train`` (sync / periodic; shared-prompt packing on / off; vllm / hf engine; the trainer and
the engine on all cores or split one core each), then TRL's ``GRPOTrainer`` on the same
workload with the same total threads (the ``trl_peer`` benchmark; needs TRL). The first step
of every run is warm-up and not counted. Every run starts in the current directory (relative
paths in the config are read from there). Prints a table (stderr) and one JSON line: each run's
completion tokens/s (completion tokens of the measured steps / their wall seconds), s/step, and
``ratio_to_trl``; the exit status is 1 if a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import megatron_rl
from megatron_rl.bench.benchmarks import BenchmarkFailed

PY = sys.executable
PACKAGE_ROOT = str(Path(megatron_rl.__file__).resolve().parents[1])  # on each run's PYTHONPATH


@dataclass(frozen=True)
class Variant:
    """One megatron_rl run: config overrides, and which cores the trainer process may use."""

    name: str
    overrides: tuple[str, ...]
    trainer_cores: str  # taskset list for the trainer process
    threads: int  # OMP threads of the trainer
    notes: dict = field(default_factory=dict)


def variants(cores: int) -> list[Variant]:
    """The megatron_rl runs compared with TRL (all cores = ``0-(cores-1)``)."""
    every = f"0-{cores - 1}"
    shared = (f'rollout.devices=["cpu:{every}"]',)
    split = ('rollout.devices=["cpu:1"]',)
    vllm = ("rollout.engine=vllm",)
    return [
        Variant("periodic_vllm_shared-prompt", ("pipeline.mode=periodic", *vllm, *shared), every, cores),
        Variant("sync_vllm_shared-prompt", ("pipeline.mode=sync", *vllm, *shared), every, cores),
        Variant(
            "periodic_vllm_k-copies",
            ("pipeline.mode=periodic", "rollout.engine=vllm", "attention.shared_prompt=false", *shared),
            every,
            cores,
        ),
        Variant("periodic_hf_shared-prompt", ("pipeline.mode=periodic", "rollout.engine=hf", *shared), every, cores),
        Variant("sync_hf_shared-prompt", ("pipeline.mode=sync", "rollout.engine=hf", *shared), every, cores),
        Variant("periodic_vllm_split-cores", ("pipeline.mode=periodic", "rollout.engine=vllm", *split), "0", 1),
    ]


def run_megatron_rl(v: Variant, config: str, steps: int, extra: list[str]) -> dict:
    """Train ``steps`` steps of ``config`` under variant ``v``; its measured figures."""
    log_dir = Path(tempfile.mkdtemp(prefix=f"bench_{v.name}_"))
    cmd = [
        "taskset",
        "-c",
        v.trainer_cores,
        PY,
        "-m",
        "megatron_rl",
        "train",
        config,
        *v.overrides,
        *extra,
        f"trainer.steps={steps}",
        f"trainer.log_dir={log_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(v.threads), "HF_HUB_OFFLINE": "1", "PYTHONPATH": PACKAGE_ROOT}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: {out.stderr[-1500:]}"}
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()][1:]
    step_s = [r["time/step_s"] for r in rows]
    tokens = [r["rollout/response_tokens"] for r in rows]
    return summarize(
        step_s,
        tokens,
        reward=[r["rollout/reward_mean"] for r in rows],
        phases={
            k: sum(r.get(f"time/{k}_s", 0.0) for r in rows) / len(rows)
            for k in ("queue_wait", "generation", "train", "optimizer", "weight_sync", "idle")
        },
    )


def run_trl(config: str, steps: int, extra: list[str], threads: int) -> dict:
    """TRL's GRPOTrainer on the same workload (the ``trl_peer`` benchmark), ``threads`` torch threads."""
    peer = [PY, "-m", "megatron_rl", "bench", "trl_peer", config, *extra]
    cmd = [*peer, "--steps", str(steps), "--threads", str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "PYTHONPATH": PACKAGE_ROOT}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: {out.stderr[-1500:]}"}
    peer = json.loads(out.stdout.strip().splitlines()[-1])
    result = summarize(peer["step_s"][1:], peer["completion_tokens"][1:], reward=peer["reward"][1:])
    return {**result, "trl": peer["trl"]}


def summarize(step_s: list[float], tokens: list[float], **more) -> dict:
    """Completion tokens/s over the measured steps, mean s/step, and whatever else is given."""
    if not step_s:
        return {"error": "no measured steps (raise --steps)"}
    return {
        "completion_tokens_per_s": sum(tokens) / sum(step_s),
        "s_per_step": sum(step_s) / len(step_s),
        "measured_steps": len(step_s),
        **more,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: config and overrides, steps, cores, which runs."""
    p.add_argument("--config", default="examples/demo/config.yaml")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is warm-up")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="cores every run may use")
    p.add_argument("--only", default="", help="comma-separated variant names (and/or 'trl') to run")
    p.add_argument("overrides", nargs="*", help="a.b=c overrides applied to every run (TRL's too)")


def run(args: argparse.Namespace) -> dict:
    """Every chosen run, one after another; their figures (``BenchmarkFailed`` if one failed)."""
    model = Path(yaml.safe_load(Path(args.config).read_text())["model"]["hf_path"])
    if not (model / "config.json").exists():
        print(
            f"megatron_rl bench throughput: {args.config}: model.hf_path {model} holds no checkpoint; for the "
            f"demo run `make demo` or `python tools/prepare_model.py --out {model} --dtype float32` first",
            file=sys.stderr,
        )
        raise SystemExit(2)
    results = _run_all(args, set(filter(None, args.only.split(","))))
    trl = results.get("trl_grpo_trainer", {}).get("completion_tokens_per_s")
    for r in results.values():
        if trl and "completion_tokens_per_s" in r:
            r["ratio_to_trl"] = r["completion_tokens_per_s"] / trl
    _print_table(results)
    line = {"bench": "throughput", "config": args.config, "steps": args.steps, "cores": args.cores, "runs": results}
    if any("error" in r for r in results.values()):
        raise BenchmarkFailed(line)
    return line


def _run_all(args: argparse.Namespace, chosen: set[str]) -> dict[str, dict]:
    """The megatron_rl variants in ``chosen`` (all if empty), then TRL; each run's figures by name."""
    results: dict[str, dict] = {}
    for v in variants(args.cores):
        if not chosen or v.name in chosen:
            results[v.name] = run_megatron_rl(v, args.config, args.steps, args.overrides)
            print(f"{v.name}: {results[v.name]}", file=sys.stderr, flush=True)
    if not chosen or "trl" in chosen:
        results["trl_grpo_trainer"] = run_trl(args.config, args.steps, args.overrides, args.cores)
        print(f"trl: {results['trl_grpo_trainer']}", file=sys.stderr, flush=True)
    return results


def _print_table(results: dict[str, dict]) -> None:
    """Completion tokens/s, s/step and the ratio to TRL per run, on stderr."""
    print(f"{'run':32s} {'compl tok/s':>12s} {'s/step':>8s} {'ratio':>6s}", file=sys.stderr)
    for name, r in results.items():
        print(
            f"{name:32s} {r.get('completion_tokens_per_s', float('nan')):12.1f} "
            f"{r.get('s_per_step', float('nan')):8.1f} {r.get('ratio_to_trl', float('nan')):6.2f}",
            file=sys.stderr,
        )
