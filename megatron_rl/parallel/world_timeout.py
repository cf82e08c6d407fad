"""``parallel.timeout_s``: how long a rank may wait for the rest of the world, and the error that
names it when the wait expires.

One knob bounds every wait of a run, generation included:
- global rank 0 waits at most ``timeout_s`` for the pipeline's next item (a group or the end of
  a step: generation and scoring); then it raises ``WorldTimeout`` and tells every other rank,
  which raises ``WorldTimeout`` with the same reason (``replica.follow``);
- every process group (torch.distributed's default group, megatron-core's groups through
  ``distributed_timeout_minutes``, the host gloo groups of ``parallel.state``, the dispatch
  group of ``trainer.data_parallel``) is created with ``group_timeout(timeout_s)``: the knob
  plus ``GRACE_S``, so rank 0's own, named error reaches the followers before their
  collectives expire. A follower whose wait for rank 0 still expires (rank 0 hung or dead)
  raises ``WorldTimeout`` naming the knob and the call it was waiting for.

Before this knob the waits were fixed (600 s default group, 30 min megatron groups) and a
long generation ended the job with a watchdog error that named nothing.
"""

from __future__ import annotations

import math
from datetime import timedelta

GRACE_S = 30.0  # process groups wait this much longer than rank 0's wait for generation


class WorldTimeout(RuntimeError):
    """A rank waited longer than ``parallel.timeout_s`` for the rest of the world."""


def group_timeout(timeout_s: float) -> timedelta:
    """The timeout every process group is created with: ``timeout_s`` + ``GRACE_S``."""
    return timedelta(seconds=timeout_s + GRACE_S)


def group_timeout_minutes(timeout_s: float) -> int:
    """``group_timeout`` in whole minutes (megatron-core's ``distributed_timeout_minutes``), rounded up."""
    return max(1, math.ceil(group_timeout(timeout_s).total_seconds() / 60))


def generation_timeout(timeout_s: float, waited_s: float, what: str) -> WorldTimeout:
    """Rank 0's error: nothing came from generation for ``waited_s`` seconds."""
    return WorldTimeout(
        f"parallel.timeout_s={timeout_s:g} expired: global rank 0 waited {waited_s:.1f} s for {what} "
        "(generation and scoring) while every other rank waited for rank 0; raise parallel.timeout_s "
        "if generations this long are expected, else look at the engines (rollout.request_timeout_s)"
    )


def follower_timeout(rank: int, timeout_s: float | None, waiting_for: str, err: BaseException) -> WorldTimeout:
    """A follower's error: its wait for ``waiting_for`` failed or expired."""
    limit = "parallel.timeout_s" if timeout_s is None else f"parallel.timeout_s={timeout_s:g} (+{GRACE_S:g} s grace)"
    return WorldTimeout(
        f"rank {rank}: waiting for {waiting_for} failed after {limit}: rank 0 is hung, dead or "
        f"stuck beyond the limit ({type(err).__name__}: {err})"
    )


_CURRENT: list[float | None] = [None]  # the run's parallel.timeout_s (initialize_parallel sets it)


def set_timeout(timeout_s: float) -> None:
    """Record the run's ``parallel.timeout_s`` (``initialize_parallel``)."""
    _CURRENT[0] = timeout_s


def current_timeout_s() -> float | None:
    """The run's ``parallel.timeout_s``, None before ``initialize_parallel``."""
    return _CURRENT[0]


def current_group_timeout() -> timedelta | None:
    """``group_timeout`` of the run's knob (None before ``initialize_parallel``: torch's default)."""
    return None if _CURRENT[0] is None else group_timeout(_CURRENT[0])
