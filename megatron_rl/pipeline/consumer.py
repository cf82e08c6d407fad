"""The consumer side: ``Pipeline`` owns the producer thread and trains one batch per ``train_step``.

    with Pipeline(engine=..., prompts=..., reward_fn=..., detokenize=..., controller=...,
                  sampling=..., scoring=..., settings=..., start_step=s0, num_steps=n) as pipe:
        for _ in range(n):
            report = pipe.train_step(trainer)   # pop groups -> micro-batches -> trainer -> finish
            log(report)

``train_step`` pops the step's groups from the bounded queue. ``periodic`` / ``stale``: kept
groups are packed greedily under ``micro_batch_tokens`` in arrival order and handed to
``trainer.train_micro_batch`` as soon as a micro-batch is full, or as soon as the queue is
momentarily empty (``flush_when_idle``), so training overlaps generation. ``sync``: the whole
batch is received first, then packed in prompt order. After the ``BatchEnd``:
``trainer.finish_batch(summary)`` (optimizer step(s), weight snapshot, ``engine.update_weights``)
returns the new version, the controller observes the step's response lengths, and the version
is published, which releases the producer.

Shutdown contract: a producer failure surfaces here as ``PipelineError`` (``__cause__`` = the
original) at the next pop, within ``poll_s``; any exception in ``train_step`` (trainer or
producer) stops the producer, joins it and shuts the engine down before propagating. The
pipeline owns the engine's lifetime from ``start`` on. In ``stale`` mode ``finish_batch``
runs while the producer may be iterating ``engine.generate``: the engine must accept
``update_weights`` concurrently (results then carry the version that produced them).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_rl.control import GroupSizeController
from megatron_rl.pipeline.producer import Detokenize, GroupScoring, Producer, PromptSource, RewardCallable
from megatron_rl.pipeline.records import (
    BatchEnd,
    MicroBatch,
    PipelineError,
    QueueItem,
    ScoredGroup,
    check_fits,
    chunk_by_tokens,
    make_micro_batch,
)
from megatron_rl.pipeline.versions import (
    PipelineMode,
    PolicyVersions,
    StalenessStats,
    VersionSchedule,
    check_mode,
    staleness_stats,
)
from megatron_rl.rollout.types import RolloutEngine, SamplingSettings


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """Scheduling between rollout and training (mirrors ``pipeline`` in the config)."""

    mode: PipelineMode = "periodic"  # sync, periodic (on-policy), stale (off-policy, needs max_staleness)
    max_staleness: int = 0  # stale: max versions a sample may lag (>= 1); else 0
    queue_size: int = 64  # max groups waiting between producer and consumer
    micro_batch_tokens: int = 4096  # packed-token budget of one micro-batch
    seed: int = 0  # base of the per-request sampling seeds
    flush_when_idle: bool = True  # periodic/stale: train a partial micro-batch rather than wait
    poll_s: float = 0.05  # how often blocked threads re-check stop / failure
    join_timeout_s: float = 10.0  # how long close() waits for the producer thread
    # The producer thread shares the interpreter with the training thread, whose Python-level
    # work holds the GIL; with CPython's default 5 ms switch interval every hand-off can keep
    # the engines waiting for their next chunk (measured: +25% generation time while training
    # overlaps). While the pipeline runs, the interval is lowered to this (None: left alone).
    gil_switch_interval_s: float | None = 0.0005

    def __post_init__(self) -> None:
        check_mode(self.mode, self.max_staleness)
        for name in ("queue_size", "micro_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"pipeline.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("poll_s", "join_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"pipeline.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class BatchSummary:
    """What the consumer saw of one step; handed to ``finish_batch`` and returned in the report."""

    step: int
    policy_version: int  # version trained on this step
    end: BatchEnd  # response lengths (all groups), group size, produced / dropped counts, source state
    staleness: StalenessStats  # over trained samples
    num_micro_batches: int
    trained_groups: int
    trained_responses: int
    trained_response_tokens: int
    reward_mean: float  # mean task reward over every sample of the step, dropped groups included
    wait_s: float  # time the consumer spent blocked on the queue during this step


class TrainerStep(Protocol):
    """The trainer as the consumer sees it (the tri-model step, optimizer and weight sync)."""

    def train_micro_batch(self, mb: MicroBatch) -> Any:
        """Forward/backward on one micro-batch, accumulating gradients; returns its metrics."""
        ...

    def finish_batch(self, summary: BatchSummary) -> int:
        """Optimizer step(s), weight snapshot, ``engine.update_weights``; return the new version,
        which must be ``summary.policy_version + 1`` and loaded in the engine on return."""
        ...


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """Result of ``Pipeline.train_step``."""

    summary: BatchSummary
    new_version: int
    micro_batch_metrics: tuple[Any, ...]  # what train_micro_batch returned, in call order


class _BatchAccumulator:
    """Groups popped for one step, and the summary they add up to."""

    def __init__(self, step: int, policy_version: int) -> None:
        self.step, self.policy_version = step, policy_version
        self.groups: list[ScoredGroup] = []
        self.end: BatchEnd | None = None
        self.num_micro_batches = 0

    def add(self, item: QueueItem) -> None:
        if item.step != self.step:
            raise RuntimeError(f"consumer expected an item of step {self.step}, got step {item.step}")
        if isinstance(item, BatchEnd):
            self.end = item
        else:
            self.groups.append(item)

    def summary(self, wait_s: float) -> BatchSummary:
        assert self.end is not None and len(self.groups) == self.end.groups_produced
        kept = [s for g in self.groups if g.kept for s in g.samples]
        rewards = [s.reward for g in self.groups for s in g.samples]
        return BatchSummary(
            step=self.step, policy_version=self.policy_version, end=self.end,
            staleness=staleness_stats([s.weight_version for s in kept], self.policy_version),
            num_micro_batches=self.num_micro_batches, trained_groups=sum(g.kept for g in self.groups),
            trained_responses=len(kept), trained_response_tokens=sum(len(s.response_ids) for s in kept),
            reward_mean=sum(rewards) / max(len(rewards), 1), wait_s=wait_s,
        )


class Pipeline:
    """Producer thread + bounded queue + the consumer loop of one training run."""

    def __init__(
        self, *, engine: RolloutEngine, prompts: PromptSource, reward_fn: RewardCallable, detokenize: Detokenize,
        controller: GroupSizeController, sampling: SamplingSettings, scoring: GroupScoring,
        settings: PipelineSettings, num_steps: int, start_step: int = 0,
    ) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.settings, self._engine, self._controller = settings, engine, controller
        self._controller_lock = threading.Lock()
        self._queue: queue.Queue[QueueItem] = queue.Queue(maxsize=settings.queue_size)
        base = engine.weight_version
        self.versions = PolicyVersions(base)
        self.schedule = VersionSchedule(mode=settings.mode, max_staleness=settings.max_staleness, base_version=base)
        self._start_step, self._num_steps, self._batch_index = start_step, num_steps, 0
        self._producer = Producer(
            engine=engine, prompts=prompts, reward_fn=reward_fn, detokenize=detokenize, controller=controller,
            controller_lock=self._controller_lock, versions=self.versions, schedule=self.schedule,
            sampling=sampling, scoring=scoring, out=self._queue, start_step=start_step, num_steps=num_steps,
            seed=settings.seed, poll_s=settings.poll_s,
        )
        self._started = self._closed = False

    def start(self) -> Pipeline:
        """Start the producer thread (idempotent)."""
        if self._closed:
            raise PipelineError("the pipeline is closed")
        if not self._started:
            self._started = True
            self._saved_switch_interval = sys.getswitchinterval()
            if self.settings.gil_switch_interval_s is not None:
                sys.setswitchinterval(min(self._saved_switch_interval, self.settings.gil_switch_interval_s))
            self._producer.start()
        return self

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
        else:
            self._shutdown()  # the propagating exception matters more than a slow join

    def train_step(self, trainer: TrainerStep) -> StepReport:
        """Consume the next step's groups, train them, finish the batch; see the module doc."""
        self.start()
        if self._batch_index >= self._num_steps:
            raise PipelineError(f"all num_steps={self._num_steps} steps were already trained")
        try:
            return self._train_step(trainer)
        except BaseException:
            self._shutdown()
            raise

    def close(self) -> None:
        """Stop and join the producer, shut the engine down (idempotent). ``PipelineError`` if
        the thread does not exit within ``join_timeout_s``."""
        if not self._shutdown():
            raise PipelineError(f"the producer thread did not exit within {self.settings.join_timeout_s} s")

    def _shutdown(self) -> bool:
        if not self._closed:
            self._closed = True
            self._producer.stop()
            self._engine.shutdown()  # also releases a producer stuck inside engine.generate
            self._producer.join(self.settings.join_timeout_s)
            if self._started:
                sys.setswitchinterval(self._saved_switch_interval)
        return not self._producer.is_alive()

    def _train_step(self, trainer: TrainerStep) -> StepReport:
        i = self._batch_index
        acc = _BatchAccumulator(self._start_step + i, self.schedule.policy_version(i))
        self._wait_s = 0.0
        batches = self._synced(acc) if self.settings.mode == "sync" else self._streamed(acc)
        metrics = tuple(trainer.train_micro_batch(mb) for mb in batches)
        summary = acc.summary(self._wait_s)
        new_version = trainer.finish_batch(summary)
        if self._engine.weight_version != new_version:
            raise RuntimeError(f"finish_batch returned version {new_version} but the engine runs "
                               f"{self._engine.weight_version}: finish_batch must call engine.update_weights")
        with self._controller_lock:
            self._controller.observe(summary.end.response_lengths)
        self.versions.publish(new_version)  # ValueError unless policy_version + 1
        self._batch_index += 1
        return StepReport(summary=summary, new_version=new_version, micro_batch_metrics=metrics)

    def _synced(self, acc: _BatchAccumulator) -> Iterator[MicroBatch]:
        """sync: receive the whole batch, then pack the kept groups in prompt order."""
        while acc.end is None:
            acc.add(self._pop())
        kept = sorted((g for g in acc.groups if g.kept), key=lambda g: g.prompt_index)
        for chunk in chunk_by_tokens(kept, self.settings.micro_batch_tokens):
            yield self._micro_batch(chunk, acc)

    def _streamed(self, acc: _BatchAccumulator) -> Iterator[MicroBatch]:
        """periodic / stale: pack kept groups in arrival order, yield as soon as a batch is due."""
        budget, buf, used = self.settings.micro_batch_tokens, [], 0
        while acc.end is None:
            item = self._pop()
            acc.add(item)
            if isinstance(item, BatchEnd) or not item.kept:
                continue
            n = check_fits(item, budget)
            if buf and used + n > budget:
                yield self._micro_batch(buf, acc)
                buf, used = [], 0
            buf.append(item)
            used += n
            if self.settings.flush_when_idle and self._queue.empty():
                yield self._micro_batch(buf, acc)
                buf, used = [], 0
        if buf:
            yield self._micro_batch(buf, acc)

    def _micro_batch(self, groups: list[ScoredGroup], acc: _BatchAccumulator) -> MicroBatch:
        acc.num_micro_batches += 1
        return make_micro_batch(groups, policy_version=acc.policy_version)

    def _pop(self) -> QueueItem:
        """Next queue item; ``PipelineError`` as soon as the producer has failed or exited."""
        t0 = time.monotonic()
        try:
            while True:
                self._raise_if_failed()
                try:
                    return self._queue.get(timeout=self.settings.poll_s)
                except queue.Empty:
                    if not self._producer.is_alive():
                        return self._last_item()
        finally:
            self._wait_s += time.monotonic() - t0

    def _last_item(self) -> QueueItem:
        try:  # the thread has exited, so every put it made is visible
            return self._queue.get_nowait()
        except queue.Empty:
            self._raise_if_failed()
            raise PipelineError("the producer thread stopped before finishing the step") from None

    def _raise_if_failed(self) -> None:
        err = self._producer.error
        if err is not None:
            raise PipelineError(f"the producer thread failed: {type(err).__name__}: {err}") from err
