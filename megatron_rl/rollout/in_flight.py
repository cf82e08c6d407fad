"""In-flight weight updates (``rollout.in_flight_updates``, stale mode): a weight sync reaches the
engines while their requests run, and each response token records the version that sampled it.

Parent side (``UpdateGate``): ``WorkerPool.load_weights`` no longer waits for the generate call in
progress. The generate thread reads the workers' pipes only while it holds the gate's *reading*
side, and its wait also watches the gate's wake-up pipe; an update takes the *updating* side (the
generate thread finishes the round it is in and waits), delivers the update exactly as an idle
pool would (``weight_delivery.Delivery``), and hands back what it read that was not its own: the
generation messages (``stash``) and the requests of a worker that died meanwhile (``orphan``),
which the generate thread takes first in its next round. So either thread may be the one reading,
and an update never waits for the producer to iterate its results (a producer blocked on a full
queue would otherwise hold the trainer's sync).

Worker side (``load_between_steps``): a worker that has requests running loads a ``Receive`` between
two engine steps: ``pause`` (vLLM: the running requests are taken out of the engine with the
tokens they have), load, ``resume(version)`` (the requests go back in). The KV cache is
*recomputed*: every paused request is prefilled again, prompt and tokens so far, with the new
weights, so each later token is sampled from exactly the distribution the new checkpoint gives
that prefix, and a token's behaviour log-prob is that of the version it records (what the
per-token staleness of the loss assumes, and what a teacher-forced forward of that checkpoint
reproduces: tests/test_in_flight_updates.py). Keeping the old KV blocks would save one prefill per
request and update, but the next tokens would then come from a mixture no checkpoint defines.
Peers: AReaL's interruptible generation aborts the requests on an update and re-submits prompt +
tokens so far (recompute); slime's partial rollout aborts and carries the partial response into a
later batch, prefilled again (recompute); vLLM's ``pause_generation(mode="keep")``, used by verl's
fully-async trainer, freezes requests with their KV blocks (keep); SkyRL's async trainer aborts and
re-submits with the accumulated tokens (recompute).

Bounded staleness (``max_staleness``): on an update to version V, a request whose first token was
sampled by a version older than ``V - max_staleness`` is *aborted and re-queued*: its tokens are
dropped and it starts again from its prompt at V (in the same engine, answered once as usual), so no
trained token lags its trajectory's start by more than the bound and a request's staleness never
exceeds what the pipeline's schedule allows. Within one stale-mode batch the schedule already keeps
V - first <= max_staleness (generation of batch i starts at >= base + i - k and the engine reaches
at most base + i meanwhile), so the rule bites only for requests carried past a batch boundary.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_rl.rollout.types import GenerationResult


def too_stale(first_version: int, new_version: int, max_staleness: int) -> bool:
    """Whether a request started at ``first_version`` is restarted on an update to ``new_version``."""
    return new_version - first_version > max_staleness


class UpdateGate:
    """Who reads the workers' pipes: the generate thread, or a weight update (module doc)."""

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self._cond = threading.Condition()
        self._reading = self._updating = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stash: list[tuple[Any, object]] = []  # (worker, message) read by an update, not its own
        self._orphans: list = []  # requests of workers that died during an update
        self.counters = PartialCounters()
        self.failed: str | None = None  # an update that raised: the generate call in progress fails too

    @property
    def wake_handle(self) -> int:
        """A file descriptor that turns readable when an update wants the pipes."""
        return self._wake_r

    @contextmanager
    def reading(self) -> Iterator[None]:
        """The generate thread's side: waits while an update runs."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._reading = True
        try:
            yield
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()
            self._clear_wake()

    @contextmanager
    def updating(self) -> Iterator[None]:
        """A weight update's side: wakes the generate thread and waits until it is out."""
        with self._cond:
            self._cond.wait_for(lambda: not self._updating)
            self._updating = True
            os.write(self._wake_w, b"u")
            self._cond.wait_for(lambda: not self._reading)
        try:
            yield
        except BaseException as err:
            self.failed = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            raise
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()

    def stash(self, worker, message: object) -> None:
        """Keep a generation message an update read, for the generate thread."""
        self._stash.append((worker, message))

    def orphan(self, requests: Sequence) -> None:
        """Keep the unanswered requests of a worker that died during an update."""
        self._orphans.extend(requests)

    def take(self) -> tuple[list[tuple[Any, object]], list]:
        """(stashed messages, orphaned requests), handed over once (under ``reading``)."""
        stash, orphans = self._stash, self._orphans
        self._stash, self._orphans = [], []
        return stash, orphans

    def _clear_wake(self) -> None:
        if self._wake_r < 0:  # closed: the pool shut down while a generate call was reading
            return
        try:
            while os.read(self._wake_r, 64):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Close the wake-up pipe (idempotent: the pool's shutdown and its finalizer may both call it)."""
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)


@dataclass
class PartialCounters:
    """What in-flight updates did to the results a pool answered (the ``partial/*`` metrics)."""

    results: int = 0
    updated: int = 0  # results whose tokens span more than one version
    versions: list[int] = field(default_factory=list)  # distinct versions per result
    tokens_after_update: int = 0  # tokens sampled by a version newer than their result's first
    stale_restarts: int = 0  # requests restarted by the bounded-staleness rule

    def count(self, result: GenerationResult) -> None:
        """Add one answered result."""
        versions = result.token_versions or ()
        distinct = len(set(versions)) or 1
        self.results += 1
        self.updated += distinct > 1
        self.versions.append(distinct)
        self.tokens_after_update += sum(v > result.weight_version for v in versions)

    def metrics(self) -> dict[str, float]:
        """``partial/*`` since the last call, then reset."""
        out = {
            "partial/requests_updated": float(self.updated),
            "partial/versions_per_trajectory_mean": sum(self.versions) / len(self.versions) if self.versions else 1.0,
            "partial/versions_per_trajectory_max": float(max(self.versions, default=1)),
            "partial/tokens_after_update": float(self.tokens_after_update),
            "partial/stale_restarts": float(self.stale_restarts),
        }
        self.results = self.updated = self.tokens_after_update = self.stale_restarts = 0
        self.versions = []
        return out


class PausableBackend(Protocol):
    """A backend that takes weight updates while requests run (module doc)."""

    in_flight_staleness: int | None  # None: in-flight updates off

    def pause(self) -> None:
        """Stop decoding and keep each running request's tokens (before a load)."""
        ...

    def resume(self, version: int) -> int:
        """Carry on at ``version`` (prefixes prefilled again); returns how many requests were
        restarted by the bounded-staleness rule."""
        ...


def load_between_steps(backend: PausableBackend, conn, command, version: int, receive: Callable) -> int:
    """Load ``command`` (a ``worker.Receive``) into a backend with requests running: pause, load,
    resume; answer ``Loaded`` (with the restarts) or ``Failed``; return the version now run."""
    from megatron_rl.rollout.worker import Failed, Loaded

    backend.pause()
    try:
        receive(backend, command.load)
    except Exception:
        backend.resume(version)
        conn.send(Failed((), traceback.format_exc()))
        return version
    new = command.version if command.load.loads else version
    restarted = backend.resume(new)
    conn.send(Loaded(new, stale_restarts=restarted))
    return new
