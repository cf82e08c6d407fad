"""The mismatch alarm at the optimizer step: one verdict, taken by every rank of the world.

The decision itself is the pure ``algorithms.correction.alarm_verdict``. Here the mismatch
metrics of a mini-batch's micro-batches are first reduced over the training world (sums with
SUM, maxima with MAX): ranks without a loss (first pipeline stages) contribute zeros, and the
TP ranks of one replica, which hold identical copies, scale a sum and its count alike, so
no mean or maximum changes. Every rank then sees the same numbers and takes the same
decision; none enters the optimizer's collectives alone while the others stop.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_rl.algorithms import MismatchAlarm, MismatchAlarmError, MismatchMetrics, alarm_verdict

logger = logging.getLogger(__name__)


def world_mismatch(local: MismatchMetrics | None, *, device: torch.device) -> MismatchMetrics | None:
    """``local`` reduced over the default process group (returned as is when not distributed).
    The metrics are device scalars: they are stacked and reduced on ``device``, no host copy."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return local
    sums = torch.zeros(len(MismatchMetrics.SUM_FIELDS), dtype=torch.float64, device=device)
    peaks = torch.zeros(len(MismatchMetrics.MAX_FIELDS), dtype=torch.float64, device=device)
    if local is not None:
        sums = torch.stack([getattr(local, f).detach().to(device, torch.float64) for f in MismatchMetrics.SUM_FIELDS])
        peaks = torch.stack([getattr(local, f).detach().to(device, torch.float64) for f in MismatchMetrics.MAX_FIELDS])
    dist.all_reduce(sums)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    named = dict(zip(MismatchMetrics.SUM_FIELDS, sums, strict=True))
    named.update(zip(MismatchMetrics.MAX_FIELDS, peaks, strict=True))
    return MismatchMetrics(**named)


def check_mismatch(alarm: MismatchAlarm | None, local: MismatchMetrics | None, *,
                   device: torch.device | None = None) -> str | None:
    """Apply ``alarm`` to this mini-batch's metrics (call on every rank, before the step).

    Returns the warning text when the alarm fired with ``action: warn`` (logged on rank 0),
    None when it stayed silent; raises ``MismatchAlarmError`` when it fired with ``stop``.
    ``device``: where the world reduction runs (the compute device; the host when None).
    """
    if alarm is None:
        return None
    verdict = alarm_verdict(alarm, world_mismatch(local, device=device or torch.device("cpu")))
    if verdict is None:
        return None
    if alarm.action == "stop":
        raise MismatchAlarmError(f"{verdict} Stopped before the optimizer step (mismatch_alarm.action: stop).")
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning("%s", verdict)
    return verdict
