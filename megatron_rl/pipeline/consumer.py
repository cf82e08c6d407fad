"""The consumer side: ``Pipeline`` owns the producer thread and hands the trainer one step at a time.

    inputs = RolloutInputs(engine=..., prompts=..., generator=..., reward_fn=..., controller=..., scoring=...)
    with Pipeline(inputs, settings, StepSpan(start_step=s0, num_steps=n)) as pipe:
        for _ in range(n):
            batch = pipe.begin_step()                      # this step's groups, as they arrive
            for mini_batch in batch.mini_batches():        # prompt order (``batching``)
                for micro_batch in mini_batch:
                    trainer.train_micro_batch(micro_batch)
                trainer.optimizer_step()
            version = trainer.sync_weights(batch.policy_version + 1)   # engine.load_weights
            summary = pipe.complete(batch, version)        # publishes the version to the producer

``complete`` checks that the engine runs the new version, then publishes it, which releases
the producer (``sync`` / ``periodic``: generation of the next batch waits for it).

Shutdown contract: a producer failure surfaces as ``PipelineError`` (``__cause__`` = the
original) at the next pop, within ``poll_s``, and stops the pipeline. Leaving the ``with``
block with an exception (trainer or producer) stops the producer, joins it and shuts the
engine down before the exception propagates. The pipeline owns the engine's lifetime from
``start`` on. In ``stale`` mode ``sync_weights`` runs while the producer may be iterating
``engine.generate``: the engine must accept ``load_weights`` concurrently (results then
carry the version that produced them).
"""

from __future__ import annotations

import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.config.fields import require_values
from megatron_rl.config.schema import PipelineConfig, SamplingConfig, TrainerConfig
from megatron_rl.config.sections import require_valid
from megatron_rl.generation.metrics import multiturn_metrics
from megatron_rl.parallel.world_timeout import generation_timeout
from megatron_rl.pipeline.batching import BatchCutting, StepBatch
from megatron_rl.pipeline.inputs import RolloutInputs, StepSpan
from megatron_rl.pipeline.producer import Producer
from megatron_rl.pipeline.recording import NullEngine, QueueRecorder, ReplayInputs, ReplayProducer
from megatron_rl.pipeline.records import BatchEnd, BatchStart, PipelineError, QueueItem
from megatron_rl.pipeline.versions import (
    PolicyVersions,
    StalenessStats,
    VersionSchedule,
    staleness_stats,
)


@dataclass(frozen=True, kw_only=True)
class PipelineSettings(PipelineConfig):
    """The ``pipeline`` config section (mode, max_staleness, queue_size, micro_batch_tokens: each
    knob and default declared once, in the schema) plus what the run fixes from other sections
    and the threads' timing."""

    mini_batches: int = TrainerConfig.mini_batches  # trainer.mini_batches: optimizer steps per batch
    seed: int = SamplingConfig.seed  # rollout.sampling.seed: base of the per-request sampling seeds
    flush_when_idle: bool = True  # periodic/stale: train a partial micro-batch rather than wait
    poll_s: float = 0.05  # how often blocked threads re-check stop / failure
    join_timeout_s: float = 10.0  # how long close() waits for the producer thread
    world_timeout_s: float | None = None  # parallel.timeout_s: the longest wait for the next item; None: no limit
    # parallel.ep > 1: the replicas train equal numbers of micro-batches per mini-batch, in rounds
    # (``batching``: the MoE layers' EP collectives span the DP replicas)
    lockstep_replicas: bool = False
    # The producer thread shares the interpreter with the training thread, whose Python-level
    # work holds the GIL; with CPython's default 5 ms switch interval every hand-off can keep
    # the engines waiting for their next chunk (measured: +25% generation time while training
    # overlaps). While the pipeline runs, the interval is lowered to this (None: left alone).
    gil_switch_interval_s: float | None = 0.0005

    def __post_init__(self) -> None:
        require_valid(self, "pipeline")  # the config's own pipeline rules
        require_values({"trainer.mini_batches": self.mini_batches})
        for name in ("poll_s", "join_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"pipeline.{name} must be > 0, got {getattr(self, name)}")

    def cutting(self, replicas: int) -> BatchCutting:
        """How each step's groups are cut into mini- and micro-batches for ``replicas`` DP replicas."""
        return BatchCutting(
            mini_batches=self.mini_batches,
            token_budget=self.micro_batch_tokens,
            streamed=self.mode != "sync",
            flush_when_idle=self.flush_when_idle,
            replicas=replicas,
            lockstep=self.lockstep_replicas,
        )


@dataclass(frozen=True, kw_only=True)
class BatchSummary:
    """What the consumer saw of one step (returned by ``complete``)."""

    step: int
    policy_version: int  # version trained on this step
    new_version: int  # version published after the step (policy_version + 1)
    end: BatchEnd  # response lengths (all groups), G, produced / dropped counts, source + controller state
    staleness: StalenessStats  # over trained samples
    num_micro_batches: int
    overlapped_micro_batches: int  # micro-batches trained while the step was still generating
    trained_groups: int
    trained_responses: int
    trained_response_tokens: int
    trained_prompt_tokens: int  # each trained sample's prompt counted once per sample (not shared)
    reward_mean: float  # mean task reward over every sample of the step, dropped groups included
    wait_s: float  # time the consumer spent blocked on the queue during this step
    extra_metrics: dict[str, float] = field(default_factory=dict)  # e.g. data/..., reward/... counters


def summarize(
    batch: StepBatch, new_version: int, wait_s: float, extra_metrics: dict[str, float] | None = None
) -> BatchSummary:
    """The ``BatchSummary`` of a finished ``StepBatch``."""
    kept_groups = [g for g in batch.groups if g.kept]
    kept = [s for g in kept_groups for s in g.samples]
    rewards = [s.reward for g in batch.groups for s in g.samples]
    turns = multiturn_metrics(batch.groups)
    return BatchSummary(
        step=batch.step,
        policy_version=batch.policy_version,
        new_version=new_version,
        end=batch.finish(),
        staleness=staleness_stats(
            [s.weight_version for s in kept],
            batch.policy_version,
            token_versions=[s.versions_per_token for s in kept],
        ),
        num_micro_batches=batch.num_micro_batches,
        overlapped_micro_batches=batch.overlapped_micro_batches,
        trained_groups=len(kept_groups),
        trained_responses=len(kept),
        trained_response_tokens=sum(len(s.response_ids) for s in kept),
        trained_prompt_tokens=sum(len(s.prompt_ids) for s in kept),
        reward_mean=sum(rewards) / max(len(rewards), 1),
        wait_s=wait_s,
        extra_metrics={
            **(extra_metrics or {}),
            **turns,
            "train/dp_imbalance": batch.router.imbalance(),
            **_padding_metrics(batch),
        },
    )


def _padding_metrics(batch: StepBatch) -> dict[str, float]:
    """Lockstep replicas (expert parallelism): the padding micro-batches the step needed."""
    return {"train/padding_micro_batches": float(batch.padding_micro_batches)} if batch.lockstep else {}


class Pipeline:
    """Producer thread + bounded queue + the consumer side of one training run."""

    def __init__(
        self,
        inputs: RolloutInputs | ReplayInputs,
        settings: PipelineSettings,
        steps: StepSpan,
        *,
        record: str | Path | None = None,
        extra_metrics: Callable[[], dict[str, float]] | None = None,
        replicas: int = 1,
    ) -> None:
        """``inputs``: what generates the batches, or a recording replayed instead (``replaying``);
        ``record``: write every queue item to this JSONL file; ``extra_metrics``: counters added
        to every step's summary (data skipped, reward failures); ``replicas``: data-parallel
        replicas the micro-batches are routed to (``pipeline.dispatch``)."""
        self.settings, self._engine = settings, inputs.engine
        self._teacher = inputs.teacher if isinstance(inputs, RolloutInputs) else None  # a replay has none
        self._queue: queue.Queue[QueueItem] = queue.Queue(maxsize=settings.queue_size)
        base = inputs.engine.weight_version
        self.versions = PolicyVersions(base)
        self.schedule = VersionSchedule(mode=settings.mode, max_staleness=settings.max_staleness, base_version=base)
        self._start_step, self._num_steps, self._batch_index = steps.start_step, steps.num_steps, 0
        self._recorder = QueueRecorder(record) if record is not None else None
        self._producer = self._make_producer(inputs, steps)
        self._extra_metrics = extra_metrics or dict
        self._replicas = replicas
        self._current: StepBatch | None = None
        self._wait_s = 0.0
        self._started = self._closed = False

    def _make_producer(self, inputs: RolloutInputs | ReplayInputs, steps: StepSpan) -> Producer | ReplayProducer:
        poll_s = self.settings.poll_s
        if isinstance(inputs, ReplayInputs):
            return ReplayProducer(inputs.path, steps, out=self._queue, poll_s=poll_s)
        return Producer(
            inputs,
            steps,
            versions=self.versions,
            schedule=self.schedule,
            out=self._queue,
            seed=self.settings.seed,
            poll_s=poll_s,
            record=self._recorder,
        )

    @classmethod
    def replaying(
        cls, path: str | Path, *, engine: NullEngine, settings: PipelineSettings, steps: StepSpan, replicas: int
    ) -> Pipeline:
        """A pipeline fed by a recording (``rollout.record``) instead of engines: no reward function,
        prompts or controller; ``engine`` only counts versions (``python -m megatron_rl replay``)."""
        return cls(ReplayInputs(path=Path(path), engine=engine), settings, steps, replicas=replicas)

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
            self.abort()  # the propagating exception matters more than a slow join

    def abort(self) -> None:
        """Stop the producer and shut the engine down without raising (an error is in flight)."""
        self._shutdown()

    def begin_step(self) -> StepBatch:
        """The next step's ``StepBatch``: its groups arrive as the engines finish them."""
        self.start()
        if self._current is not None:
            raise PipelineError(f"step {self._current.step} was begun but not completed")
        if self._batch_index >= self._num_steps:
            raise PipelineError(f"all num_steps={self._num_steps} steps were already trained")
        self._wait_s = 0.0
        start = self._pop()
        expected = self._start_step + self._batch_index
        if not isinstance(start, BatchStart) or start.step != expected:
            raise PipelineError(f"expected the start of step {expected}, got {start!r}")
        s = self.settings
        self._current = StepBatch(
            start,
            self.schedule.policy_version(self._batch_index),
            s.cutting(self._replicas),
            pop=self._pop,
            queue_empty=self._queue.empty,
        )
        return self._current

    def complete(self, batch: StepBatch, new_version: int) -> BatchSummary:
        """End ``batch``'s step once the engine runs ``new_version`` (= policy_version + 1) and
        publish that version to the producer; return the step's summary."""
        if batch is not self._current:
            raise PipelineError(f"complete() got step {batch.step}, which is not the step in progress")
        summary = summarize(batch, new_version, self._wait_s, self._extra_metrics())
        if self._engine.weight_version != new_version:
            raise RuntimeError(
                f"the trainer synced version {new_version} but the engine runs "
                f"{self._engine.weight_version}: sync_weights must call engine.load_weights"
            )
        self.versions.publish(new_version)  # ValueError unless policy_version + 1
        self._batch_index += 1
        self._current = None
        return summary

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
            if self._teacher is not None:  # on-policy distillation: the teacher's pool and engines
                self._teacher.shutdown()
            self._producer.join(self.settings.join_timeout_s)
            if self._recorder is not None:
                self._recorder.close()
            if self._started:
                sys.setswitchinterval(self._saved_switch_interval)
        return not self._producer.is_alive()

    def _pop(self) -> QueueItem:
        """Next queue item; ``PipelineError`` (after stopping the pipeline) as soon as the
        producer has failed or exited."""
        t0 = time.monotonic()
        try:
            while True:
                self._raise_if_failed()
                try:
                    return self._queue.get(timeout=self.settings.poll_s)
                except queue.Empty:
                    if not self._producer.is_alive():
                        return self._last_item()
                    limit = self.settings.world_timeout_s
                    if limit is not None and time.monotonic() - t0 > limit:
                        raise generation_timeout(limit, time.monotonic() - t0, "the pipeline's next group") from None
        except PipelineError:
            self._shutdown()
            raise
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
