"""What a bench run measured: per-step records, their aggregate, the JSON line and the table.

Definitions (shared by every scope):

- ``tokens_per_s_per_device``: (prompt + response tokens of the trained samples) / devices /
  step time, MindSpeed-RL's definition (each sample counts its prompt, K times per group);
- ``samples_per_s``, ``completion_tokens_per_s``: trained (or, for ``rollout``, generated)
  samples and response tokens per second of step time;
- ``phases``: exclusive seconds of the step on its critical path (generation, reward,
  queue_wait, train, optimizer, weight_sync, idle); they sum to the step time, ``idle`` being
  what no measured phase explains (packing, bookkeeping). ``breakdown_error`` is
  |Σ phases − step| / step;
- ``mfu``: training FLOPs (``bench.flops``, shared-prompt layout) / train-phase seconds /
  (peak × training devices); None when nothing was trained.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_rl.bench.flops import GroupShape

PHASES = ("generation", "reward", "queue_wait", "train", "optimizer", "weight_sync", "idle")
PACKAGES = ("torch", "megatron-core", "vllm", "transformers")


@dataclass(frozen=True, kw_only=True)
class StepMeasure:
    """One measured step: its wall time, phase seconds and the groups it trained (or generated)."""

    step_s: float
    phases: Mapping[str, float]  # every key of PHASES except idle, seconds
    groups: tuple[GroupShape, ...]  # trained (train / e2e) or generated (rollout) groups
    flops: float = 0.0  # training FLOPs of the step (0 when nothing was trained)

    def with_idle(self) -> dict[str, float]:
        """The phases plus ``idle`` = step time not covered by them (never negative)."""
        out = {name: float(self.phases.get(name, 0.0)) for name in PHASES if name != "idle"}
        out["idle"] = max(self.step_s - sum(out.values()), 0.0)
        return out


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    """The aggregate over the measured (post-warm-up) steps; ``to_json`` is the output line."""

    scope: str
    steps: int
    warmup: int
    step_s: float  # mean over measured steps
    tokens_per_s_per_device: float
    samples_per_s: float
    completion_tokens_per_s: float
    tokens: dict[str, int]  # prompt (per sample), response, packed (prompt once per group), samples, groups
    phases: dict[str, float]  # mean seconds per step, PHASES order
    breakdown_error: float
    peak_memory_gb: float
    memory_kind: str  # "device" (allocator peak) or "host_rss" (process peak resident set)
    mfu: float | None
    flops_per_step: float
    peak_tflops: float
    peak_source: str
    devices: int  # devices the tokens/s are divided by
    world: dict[str, Any]  # platform, world size, tp / pp / dp, rollout engines
    versions: dict[str, str | None]
    config: dict[str, Any]
    extra: dict[str, float] = field(default_factory=dict)  # scope-specific (overlapped seconds, ...)

    def to_json(self) -> str:
        return json.dumps({"bench": asdict(self)}, sort_keys=False)


def versions() -> dict[str, str | None]:
    """Installed versions of the stack (None = not installed); no package is imported."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def aggregate(
    measured: Sequence[StepMeasure],
    *,
    scope: str,
    warmup: int,
    devices: int,
    train_devices: int,
    peak: tuple[float, str],
    memory: tuple[float, str],
    world: dict[str, Any],
    config: dict[str, Any],
    extra: Mapping[str, float] | None = None,
) -> BenchResult:
    """Rates over the measured steps (total tokens / total step time), mean phases, MFU."""
    if not measured:
        raise ValueError("bench: no measured step (--steps must be >= 1)")
    total_s = sum(m.step_s for m in measured)
    groups = [g for m in measured for g in m.groups]
    tokens = {
        "prompt": sum(len(g.response_lens) * g.prompt_len for g in groups),
        "response": sum(sum(g.response_lens) for g in groups),
        "packed": sum(g.packed_tokens for g in groups),
        "samples": sum(len(g.response_lens) for g in groups),
        "groups": len(groups),
    }
    n = len(measured)
    phases = {name: sum(m.with_idle()[name] for m in measured) / n for name in PHASES}
    train_s = sum(m.phases.get("train", 0.0) for m in measured)
    flops = sum(m.flops for m in measured)
    mfu = flops / train_s / (peak[0] * 1e12 * train_devices) if flops > 0 and train_s > 0 else None
    return BenchResult(
        scope=scope,
        steps=n,
        warmup=warmup,
        step_s=total_s / n,
        tokens_per_s_per_device=(tokens["prompt"] + tokens["response"]) / devices / total_s,
        samples_per_s=tokens["samples"] / total_s,
        completion_tokens_per_s=tokens["response"] / total_s,
        tokens=tokens,
        phases=phases,
        breakdown_error=abs(sum(phases.values()) - total_s / n) / (total_s / n),
        peak_memory_gb=memory[0],
        memory_kind=memory[1],
        mfu=mfu,
        flops_per_step=flops / n,
        peak_tflops=peak[0],
        peak_source=peak[1],
        devices=devices,
        world=world,
        versions=versions(),
        config=config,
        extra=dict(extra or {}),
    )


def phases_from_metrics(m: Mapping[str, float]) -> dict[str, float]:
    """The exclusive phase seconds (no ``idle`` unless logged) of one logged step of the loop.

    ``train`` / ``optimizer`` / ``weight_sync`` are the loop's ``time/…_s``; the trainer's queue
    wait is the exposed rollout, split into ``generation`` and ``reward`` in the producer's own
    proportion (``time/reward_s`` of ``time/generation_s``) and capped at the producer's busy time;
    the rest of the wait stays ``queue_wait``. ``idle`` is ``time/idle_s`` when logged."""
    wait, busy = m.get("time/queue_wait_s", 0.0), m.get("time/generation_s", 0.0)
    reward_share = min(m.get("time/reward_s", 0.0) / busy, 1.0) if busy > 0 else 0.0
    covered = min(wait, busy)
    out = {"generation": covered * (1 - reward_share), "reward": covered * reward_share, "queue_wait": wait - covered}
    out.update({name: m.get(f"time/{name}_s", 0.0) for name in ("train", "optimizer", "weight_sync")})
    if "time/idle_s" in m:
        out["idle"] = m["time/idle_s"]
    return out


def table_rows(result: BenchResult) -> list[tuple[str, str]]:
    """(name, value) rows of the human-readable table."""
    r = result
    rows = [
        ("scope", f"{r.scope} ({r.steps} steps after {r.warmup} warm-up)"),
        ("step time", f"{r.step_s:.3f} s"),
        ("tokens/s/device", f"{r.tokens_per_s_per_device:.1f} ({r.devices} devices)"),
        ("samples/s", f"{r.samples_per_s:.2f}"),
        ("completion tokens/s", f"{r.completion_tokens_per_s:.1f}"),
    ]
    rows += [(f"  {name}", f"{sec:.3f} s ({100 * sec / r.step_s:.1f} %)") for name, sec in r.phases.items()]
    mfu = "n/a" if r.mfu is None else f"{100 * r.mfu:.2f} % of {r.peak_tflops:.3g} TFLOP/s ({r.peak_source})"
    rows += [
        ("breakdown error", f"{100 * r.breakdown_error:.2f} %"),
        ("peak memory", f"{r.peak_memory_gb:.2f} GB ({r.memory_kind})"),
        ("training MFU", mfu),
        ("world", ", ".join(f"{k}={v}" for k, v in r.world.items())),
        ("versions", ", ".join(f"{k} {v}" for k, v in r.versions.items() if v)),
    ]
    return rows


def print_table(result: BenchResult, *, file=None) -> None:
    """The table, with rich when it is installed, else plain aligned text."""
    rows = table_rows(result)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            print(f"{key:<{width}}  {value}", file=file or sys.stdout)
        return
    table = Table(title=f"megatron_rl bench: {result.scope}", show_header=False)
    for key, value in rows:
        table.add_row(key, value)
    Console(file=file or sys.stdout, width=120).print(table)
