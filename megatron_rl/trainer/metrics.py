"""Per-step metrics: one JSON line per step in ``<log_dir>/metrics.jsonl`` and TensorBoard scalars.

Only global rank 0 writes. Values are plain floats keyed by ``group/name`` (``loss/…``,
``rollout/…``, ``control/…``, ``trimodel/…``, ``time/…``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

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
    return {
        "rollout/reward_mean": s.reward_mean, "rollout/group_size": float(end.group_size),
        "rollout/groups_dropped": float(end.groups_dropped),
        "rollout/response_tokens": float(s.trained_response_tokens), "train/responses": float(s.trained_responses),
        "rollout/mean_response_len": sum(end.response_lengths) / max(len(end.response_lengths), 1),
        "rollout/staleness_max": float(s.staleness.max), "rollout/staleness_mean": s.staleness.mean,
        "time/step_s": step_s, "time/queue_wait_s": s.wait_s, "time/generation_s": end.generation_s,
        "train/micro_batches": float(s.num_micro_batches),
        "train/overlapped_micro_batches": float(s.overlapped_micro_batches),
        "train/version": float(s.new_version),
        **end.control_metrics,  # already named control/...
        **s.extra_metrics,  # data/..., reward/... counters
    }


def step_metrics(summary: BatchSummary, results: Sequence[MiniBatchResult], seconds: Mapping[str, float], *,
                 step_s: float, memory: TriModelMemory) -> dict[str, float]:
    """The flat metrics of one step: rollout, time per phase, loss, controller, memory."""
    stepped = [r for r in results if not r.skipped]
    metrics = rollout_metrics(summary, step_s=step_s)
    metrics.update({
        **{f"time/{phase}_s": value for phase, value in seconds.items()},
        "loss/value": sum(r.loss for r in stepped) / max(len(stepped), 1),
        "loss/grad_norm": sum(r.grad_norm for r in stepped) / max(len(stepped), 1),
        "train/optimizer_steps": float(len(stepped)), "train/skipped_mini_batches": float(len(results) - len(stepped)),
        "train/nonfinite_steps": float(sum(r.nonfinite for r in results)),
    })
    if stepped:
        metrics.update(stepped[-1].metrics)
    metrics.update(memory.as_metrics())
    return metrics


def format_step(step: int, metrics: Mapping[str, float]) -> str:
    """One console line per step."""
    loss = f" loss {metrics['loss/value']:.4f}" if "loss/value" in metrics else ""
    return (f"step {step}: reward {metrics['rollout/reward_mean']:.3f}{loss} "
            f"G {metrics['rollout/group_size']:.0f} {metrics['time/step_s']:.1f}s")
