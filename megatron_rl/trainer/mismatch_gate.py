"""The mismatch alarm at the optimizer step: one verdict, taken by every rank of the world.

The decision itself is the pure ``algorithms.correction.alarm_verdict``. It reads the mismatch
metrics of the whole world (``trainer.world_metrics.world_merged``: every replica's last stage
counted once, sums added and maxima maxed), which every rank holds identically, so every rank
takes the same decision; none enters the optimizer's collectives alone while the others stop.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from megatron_rl.algorithms import MismatchAlarm, MismatchAlarmError, MismatchMetrics, alarm_verdict

logger = logging.getLogger(__name__)


def check_mismatch(
    alarm: MismatchAlarm | None, world: MismatchMetrics | None, *, when: str = "before the optimizer step"
) -> str | None:
    """Apply ``alarm`` to world mismatch metrics (call on every rank): a mini-batch's, before its
    step, or the engine probe's after a sync (``trainer.engine_probe``); ``when`` says which.

    Returns the warning text when the alarm fired with ``action: warn`` (logged on rank 0),
    None when it stayed silent; raises ``MismatchAlarmError`` when it fired with ``stop``.
    """
    if alarm is None:
        return None
    verdict = alarm_verdict(alarm, world)
    if verdict is None:
        return None
    if alarm.action == "stop":
        raise MismatchAlarmError(f"{verdict} Stopped: {when} (mismatch_alarm.action: stop).")
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning("%s (%s)", verdict, when)
    return verdict
