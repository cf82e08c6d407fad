"""Per-step metrics: one JSON line per step in ``<log_dir>/metrics.jsonl`` and TensorBoard scalars.

Only global rank 0 writes. Values are plain floats keyed by ``group/name`` (``loss/…``,
``rollout/…``, ``control/…``, ``trimodel/…``, ``time/…``).
"""

from __future__ import annotations

import functools
import json
import math
import resource
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.algorithms import LossMetrics

if TYPE_CHECKING:
    from megatron_rl.pipeline import BatchSummary
    from megatron_rl.trainer.policy_step import MiniBatchResult
    from megatron_rl.trimodel.model import TriModelMemory


class MetricsLogger:
    """Writes step metrics to JSONL and TensorBoard (rank 0); a no-op elsewhere."""

    def __init__(self, log_dir: str | Path | None) -> None:
        self.enabled = log_dir is not None and (not dist.is_initialized() or dist.get_rank() == 0)
        self._file = None
        self._tb = None
        if self.enabled:
            path = Path(log_dir)
            path.mkdir(parents=True, exist_ok=True)
            self._file = open(path / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(path / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` for ``step`` (non-finite values are kept in JSON as null)."""
        if not self.enabled:
            return
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()
        for key, value in clean.items():
            if value is not None:
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._tb.close()
            self._file = self._tb = None


def rollout_metrics(summary: BatchSummary, *, step_s: float) -> dict[str, float]:
    """What the rollout side of one step produced: rewards, lengths, staleness, timings, controller."""
    s, end = summary, summary.end
    lengths = sorted(end.response_lengths) or [0]
    return {
        "rollout/reward_mean": s.reward_mean,
        "rollout/group_size": float(end.group_size),
        "rollout/groups_dropped": float(end.groups_dropped),
        "rollout/response_tokens": float(s.trained_response_tokens),
        "train/responses": float(s.trained_responses),
        "train/prompt_tokens": float(s.trained_prompt_tokens),
        "rollout/response_len_mean": sum(lengths) / len(lengths),
        "rollout/response_len_max": float(lengths[-1]),
        "rollout/response_len_median": float(statistics.median(lengths)),
        "rollout/staleness_max": float(s.staleness.max),
        "rollout/staleness_mean": s.staleness.mean,
        "rollout/staleness_token_mean": s.staleness.token_mean,  # each token's own (in-flight updates)
        "rollout/mixed_version_samples": float(s.staleness.mixed_samples),
        "time/step_s": step_s,
        "time/queue_wait_s": s.wait_s,
        "time/generation_s": end.generation_s,
        "time/reward_s": end.reward_s,
        "train/micro_batches": float(s.num_micro_batches),
        "train/overlapped_micro_batches": float(s.overlapped_micro_batches),
        "train/version": float(s.new_version),
        **end.control_metrics,  # already named control/...
        **end.distill_metrics,  # the teacher's timings, already named distill/... (on-policy distillation)
        **s.extra_metrics,  # data/..., reward/... counters
    }


def step_metrics(
    summary: BatchSummary,
    results: Sequence[MiniBatchResult],
    seconds: Mapping[str, float],
    *,
    step_s: float,
    memory: TriModelMemory,
    devices: int,
) -> dict[str, float]:
    """The flat metrics of one step: rollout, time per phase, throughput, busy fractions, loss,
    controller, memory. ``devices``: the run's devices (training ranks + engine devices)."""
    stepped = [r for r in results if not r.skipped]
    metrics = rollout_metrics(summary, step_s=step_s)
    phases = {k: v for k, v in seconds.items() if k in TRAINER_PHASES}
    metrics.update({f"time/{phase}_s": value for phase, value in phases.items()})
    metrics.update(_throughput(metrics, phases, step_s=step_s, devices=devices))
    metrics.update(_weight_sync(seconds))
    # the engine probe's metrics (trainer.engine_probe), travelling with the seconds; absent when it did not run
    metrics.update({k: v for k, v in seconds.items() if k.startswith(("mismatch_probe/", "probe/"))})
    metrics.update(
        {
            "loss/value": sum(r.loss for r in stepped) / max(len(stepped), 1),
            "loss/grad_norm": sum(r.grad_norm for r in stepped) / max(len(stepped), 1),
            "train/optimizer_steps": float(len(stepped)),
            "train/skipped_mini_batches": float(len(results) - len(stepped)),
            "train/nonfinite_steps": float(sum(r.nonfinite for r in results)),
            "memory/peak_gb": peak_memory_gb(),
        }
    )
    device_peak = device_peak_memory_gb()
    if device_peak is not None:  # a rank on a device (CUDA / NPU / emulated): its own peak
        metrics["memory/device_peak_gb"] = device_peak
    measured = [r.loss_metrics for r in stepped if r.loss_metrics is not None]
    if measured:  # sums and maxima: the step's statistics over all its mini-batches
        metrics.update(functools.reduce(LossMetrics.merge, measured).to_log())
    metrics.update(memory.as_metrics())
    metrics.update(transfer_metrics())
    return metrics


_LAST_TRANSFERS: dict[str, object] = {}


def transfer_metrics() -> dict[str, float]:
    """``transfers/*``: host<->device copies (a ``.item()`` is one d2h) since the previous call, on
    platforms that count them (the emulated accelerator); nothing elsewhere."""
    from megatron_rl.platform import emulated

    if not emulated.is_loaded():
        return {}
    now = emulated.transfer_counts()
    delta = now - _LAST_TRANSFERS.get("counts", emulated.TransferCounts())
    _LAST_TRANSFERS["counts"] = now
    return {
        f"transfers/{name}": float(getattr(delta, name)) for name in ("h2d", "d2h", "h2d_bytes", "d2h_bytes", "syncs")
    }


# The trainer's phases (Replica.seconds); with the queue wait and idle they make up the step.
TRAINER_PHASES = ("train", "optimizer", "weight_sync", "probe")


def _throughput(
    metrics: Mapping[str, float], phases: Mapping[str, float], *, step_s: float, devices: int
) -> dict[str, float]:
    """Tokens/s/device as MindSpeed-RL reports it ((prompt + response) tokens of the trained
    samples / devices / step time), completion tokens/s, idle time and busy fractions."""
    tokens = metrics["train/prompt_tokens"] + metrics["rollout/response_tokens"]
    step = max(step_s, 1e-9)
    busy = sum(phases.values())
    return {
        "throughput/tokens_per_s_per_device": tokens / max(devices, 1) / step,
        "throughput/completion_tokens_per_s": metrics["rollout/response_tokens"] / step,
        "time/idle_s": max(step_s - busy - metrics["time/queue_wait_s"], 0.0),
        "busy/trainer": min(busy / step, 1.0),
        # The producer generates for this step while the trainer trains on it (periodic) or on the
        # previous step (stale), so this can exceed what fits inside the trainer's step time.
        "busy/engines": min(metrics["time/generation_s"] / step, 1.0),
    }


def _weight_sync(seconds: Mapping[str, float]) -> dict[str, float]:
    """Bytes handed to the engines in this step's weight sync and the rate of the transfer."""
    nbytes, transfer = seconds.get("weight_sync_bytes", 0.0), seconds.get("weight_sync_transfer", 0.0)
    if not nbytes:
        return {}
    return {
        "sync/bytes": nbytes,
        "sync/transfer_s": transfer,  # the hand-over alone, not the old-policy copy
        "sync/gb_per_s": nbytes / 1e9 / max(transfer or seconds.get("weight_sync", 0.0), 1e-9),
    }


def device_peak_memory_gb(device: torch.device | None = None) -> float | None:
    """Peak memory allocated on ``device`` (default: this rank's compute device) so far, in GB:
    CUDA, NPU or the emulated device (whose capacity makes it a real limit); None on the CPU."""
    if device is None:
        from megatron_rl.platform import compute_device

        device = compute_device()
    if device.type == "cpu":
        return None
    return getattr(torch, device.type).max_memory_allocated(device) / 1e9


def peak_memory_gb() -> float:
    """Peak memory of this process so far: device memory on CUDA / NPU / the emulated device,
    resident set on the CPU."""
    from megatron_rl.platform import current_platform

    platform = current_platform()
    if platform is not None and platform.device_type == "emulated":
        return device_peak_memory_gb(platform.device) or 0.0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 1e9
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return npu.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux


class EngineBusy:
    """``busy/engine_<i>``: the share of each step's wall time engine i had work (generation or
    weight loads), from the pool's per-worker busy clocks; nothing for engines without them.
    With in-flight updates also the pool's ``partial/*`` counters since the previous step."""

    def __init__(self, engine: object) -> None:
        self._clock = getattr(engine, "busy_seconds", None)
        self._partial = getattr(engine, "partial_metrics", None)  # rollout.in_flight: {} when off
        self._last = self._read()

    def _read(self) -> tuple[float, ...]:
        return tuple(self._clock()) if callable(self._clock) else ()  # replay / fake engines: none

    def step(self, step_s: float) -> dict[str, float]:
        """Busy fractions since the previous call (or construction)."""
        now = self._read()
        out = {
            f"busy/engine_{i}": min(max(b - a, 0.0) / max(step_s, 1e-9), 1.0)
            for i, (a, b) in enumerate(zip(self._last, now, strict=False))
        }
        self._last = now
        return out | (self._partial() if callable(self._partial) else {})


def count_devices(world_size: int, engine_devices: Sequence[str], num_engines: int) -> int:
    """Devices of a run: one per training rank plus the engines' (``rollout.devices``: "cuda:0,1"
    is two, "cpu:1" one core); an engine without a device string counts as one."""
    from megatron_rl.rollout.settings import parse_device

    named = sum(max(len(parse_device(d).ids), 1) for d in engine_devices)
    return world_size + named + max(num_engines - len(engine_devices), 0)


def format_step(step: int, metrics: Mapping[str, float]) -> str:
    """One console line per step: reward, what the update did (grad norm, clipped share of tokens,
    KL to the reference or to the old policy, trainer-engine mismatch), G, time and throughput.
    GRPO's loss is ~0 by construction (advantages are centred per group), so it stays in the
    metrics, not on the line."""
    rate = metrics.get("throughput/tokens_per_s_per_device")
    rate = f" {rate:.1f} tok/s/dev" if rate is not None else ""
    return (
        f"step {step}: reward {metrics['rollout/reward_mean']:.3f}{_update(metrics)} "
        f"G {metrics['rollout/group_size']:.0f} {metrics['time/step_s']:.1f}s{rate}{_turns(metrics)}"
    )


def _update(metrics: Mapping[str, float]) -> str:
    """What moved in the step's update ('' for a step that did not train, e.g. rollout-only)."""
    m, parts = metrics, []
    if "loss/grad_norm" in m:
        parts.append(f"gnorm {m['loss/grad_norm']:.3g}")
    if "loss/clip_frac_low" in m:
        parts.append(f"clip {m['loss/clip_frac_low'] + m.get('loss/clip_frac_high', 0.0):.1%}")
    if "loss/kl_ref" in m:
        parts.append(f"kl_ref {m['loss/kl_ref']:.2g}")
    elif "loss/approx_kl_old" in m:
        parts.append(f"kl_old {m['loss/approx_kl_old']:.2g}")
    if "mismatch/kl_k3" in m:
        parts.append(f"mismatch {m['mismatch/kl_k3']:.2g}")
    return "".join(f" {p}" for p in parts)


def _turns(metrics: Mapping[str, float]) -> str:
    """Multi-turn figures of the step ('' for single-turn runs): turns per trajectory, tool calls
    and errors, environment failures, observation share of the trained tokens, time in environments."""
    if "multiturn/turns_mean" not in metrics:
        return ""
    m = metrics
    tokens = m["multiturn/model_tokens"] + m["multiturn/observation_tokens"]
    resets = m.get("multiturn/reset_failures", 0.0)  # groups dropped for a failed environment reset
    failed = f"{m['multiturn/env_failures']:.0f} env fail" + (f", {resets:.0f} reset fail" if resets else "")
    return (
        f" | turns {m['multiturn/turns_mean']:.2f} tools {m['multiturn/tool_calls']:.0f}"
        f" ({m['multiturn/tool_errors']:.0f} err, {failed})"
        f" obs {m['multiturn/observation_tokens'] / max(tokens, 1):.0%} env {m['multiturn/env_s']:.1f}s"
    )
