"""The producer thread: prompts -> generator -> rewards -> scored groups -> queue.

Per batch i (step = start_step + i) the thread
1. waits until the engine has loaded the version the ``VersionSchedule`` requires,
2. asks the controller for G and the prompt source for the batch's prompts, and puts a
   ``BatchStart``,
3. runs the generator over the batch (``generation.Generator``: single-turn, multi-turn or any
   registered one), which yields a ``Trajectory`` per (prompt, k) as it finishes, or a
   ``FailedGroup`` for a prompt given up (put as an empty, not-kept group: ``failed_group``);
   every engine result's weight version is checked against the schedule,
4. scores each trajectory as it arrives: the environment's reward when it carries one, else the
   task reward of its last text (``reward_fn.submit`` when it has one, e.g. a
   ``rewards.RewardPool`` scoring in worker processes, else called in this thread); when a
   prompt's G samples are scored (``records.sample_from``), shapes the rewards (DAPO overlong:
   the generator says what it measures), computes the group's advantages and dynamic-sampling
   verdict and puts the ``ScoredGroup`` on the bounded queue (blocking while it is full);
   ``BatchEnd.reward_s`` is the time this thread spent in or waiting for rewards; with DAPO
   over-sampling (``GroupScoring.target_groups``, ``pipeline.oversample``) a group is put once it
   is known whether it is among the batch's first target kept groups, and the prompts that cannot
   be are aborted in the engine (``WorkerPool.abort``; their late results are ignored, or with
   ``RolloutInputs.carry_over`` kept: the aborted prompts, with their tokens so far, open the next
   batch: ``pipeline.carry_over``),
5. after the last group, lets the controller observe the batch's response lengths and puts a
   ``BatchEnd`` carrying the controller's metrics and state.

The thread owns the group-size controller: it observes batch i before it chooses G for batch
i + 1, so every observation is credited to the G that produced it, also in ``stale`` mode
where generation runs ahead of training.

Contract: the thread never raises. Any error is stored in ``error`` and the thread exits; the
consumer turns it into a ``PipelineError``. ``stop()`` makes every blocking point (full queue,
waiting for a version, between engine results) return within ``poll_s``. Group advantages are
per group, so ``scale="batch"`` (which needs the whole batch) is refused.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace
from typing import Any

from megatron_rl.generation.base import BatchRequest, FailedGroup, PromptItem, Trajectory
from megatron_rl.pipeline.carry_over import CarriedBatch, batch_prompts
from megatron_rl.pipeline.inputs import RolloutInputs, StepSpan
from megatron_rl.pipeline.oversample import ABORTED, DROPPED, Oversampler
from megatron_rl.pipeline.records import (
    BatchEnd,
    BatchStart,
    QueueItem,
    Sample,
    ScoredGroup,
    put_unless_stopped,
    sample_from,
)
from megatron_rl.pipeline.scoring import failed_group, score_group
from megatron_rl.pipeline.versions import PolicyVersions, VersionSchedule


class _Stopped(Exception):
    """Internal: unwinds the producer after ``stop()``."""


@dataclass(kw_only=True)
class _PendingBatch:
    """Bookkeeping of the batch being generated."""

    request: BatchRequest  # what the generator is asked: step, prompts, G, seeds
    source_state: Mapping[str, Any] | None  # the prompt source's state_dict() after drawing the batch
    where: dict[str, tuple[int, int]]  # request id -> (prompt index, k), removed when answered
    slots: list[list[Sample | None]]
    dropped: int = 0
    oversample: Oversampler | None = None  # DAPO over-sampling of this batch (pipeline.oversample)
    aborted: set[str] = field(default_factory=set)  # request ids aborted: their results are ignored (or carried)
    finished: dict[tuple[int, int], Trajectory] = field(default_factory=dict)  # carry-over: (p, k) answered
    scoring: list[tuple[int, int, Trajectory, Future]] = field(default_factory=list)  # (p, k, trajectory, reward)

    @property
    def step(self) -> int:
        return self.request.step

    @property
    def items(self) -> tuple[PromptItem, ...]:
        return self.request.items

    @property
    def group_size(self) -> int:
        return self.request.group_size


class Producer:
    """Background thread feeding ``out`` with ``ScoredGroup``s and one ``BatchEnd`` per step."""

    def __init__(
        self,
        inputs: RolloutInputs,
        steps: StepSpan,
        *,
        versions: PolicyVersions,
        schedule: VersionSchedule,
        out: queue.Queue[QueueItem],
        seed: int,
        poll_s: float,
        record: Callable[[QueueItem], None] | None,
    ) -> None:
        """``seed``: base of the per-request sampling seeds; ``record``: sees every queue item."""
        self._inputs, self._steps, self._versions, self._schedule = inputs, steps, versions, schedule
        self._out, self._seed, self._poll_s, self._record = out, seed, poll_s, record
        self._reward_s = 0.0  # seconds in reward_fn for the batch being generated
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="megatron_rl-producer", daemon=True)

    @property
    def error(self) -> BaseException | None:
        """The exception that ended the thread, if any."""
        return self._error

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to exit at its next blocking point (does not wait)."""
        self._stop.set()
        self._versions.wake()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s; True if the thread has exited."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            for i in range(self._steps.num_steps):
                self._produce_batch(i)
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 -- handed to the consumer, which re-raises it
            self._error = exc

    def _produce_batch(self, i: int) -> None:
        batch = self._open_batch(i)
        start, self._reward_s = time.perf_counter(), 0.0
        for out in self._inputs.generator.run(
            self._inputs.engine,
            batch.request,
            stop=self._stop,
            # an aborted request may be answered after the trainer took the batch and synced:
            # its result is ignored (or carried, and checked against the next batch's schedule)
            check_version=lambda rid, version: rid in batch.aborted or self._schedule.check_sample(i, version, rid),
        ):
            if self._stop.is_set():
                raise _Stopped
            if isinstance(out, FailedGroup):
                self._drop_failed_group(batch, out)
            else:
                self._accept(batch, out)
        if self._stop.is_set():
            raise _Stopped
        self._harvest(batch, wait=True)
        self._drain_teacher()
        if batch.where:
            raise RuntimeError(
                f"no trajectory came back for {len(batch.where)} requests, e.g. {next(iter(batch.where))!r}"
            )
        self._close_batch(batch, time.perf_counter() - start)

    def _open_batch(self, i: int) -> _PendingBatch:
        """Wait for batch ``i``'s weights, choose G, draw its prompts and put its ``BatchStart``."""
        if not self._versions.wait_for(self._schedule.required_version(i), self._stop, self._poll_s):
            raise _Stopped
        group_size = self._inputs.controller.choose()
        prompts = self._inputs.prompts
        carried = self._carried(i)
        items = batch_prompts(carried.items, tuple(prompts.next_batch()))
        state_fn = getattr(prompts, "state_dict", None)
        request = BatchRequest(
            step=self._steps.steps[i],
            items=items,
            group_size=group_size,
            base_seed=self._seed,
            carried=carried.trajectories,
        )
        batch = self._new_batch(request, state_fn() if callable(state_fn) else None)
        target = self._inputs.scoring.target_groups
        if target is not None and target < len(items):
            batch.oversample = Oversampler(target=target, num_prompts=len(items))
        self._put(BatchStart(step=batch.step, num_prompts=len(items), group_size=group_size))
        return batch

    def _carried(self, i: int) -> CarriedBatch:
        """The prompts the previous batch carries into batch ``i`` (none without carry-over)."""
        carry = self._inputs.carry_over
        if carry is None:
            return CarriedBatch()
        carried = carry.take(self._schedule.required_version(i))
        if carried.trajectories and not getattr(self._inputs.generator, "continues_partial", False):
            raise RuntimeError(
                f"rollout.carry_over: the generator {type(self._inputs.generator).__name__} cannot continue "
                "carried trajectories (no continues_partial)"
            )
        return carried

    def _new_batch(self, request: BatchRequest, source_state: Mapping[str, Any] | None) -> _PendingBatch:
        where: dict[str, tuple[int, int]] = {}
        for p, item in enumerate(request.items):
            for k in range(request.group_size):
                rid = request.request_id(p, k)
                if rid in where:
                    raise ValueError(
                        f"prompt_id {item.record.prompt_id!r} appears twice in the batch of step {request.step}"
                    )
                where[rid] = (p, k)
        return _PendingBatch(
            request=request,
            source_state=source_state,
            where=where,
            slots=[[None] * request.group_size for _ in request.items],
        )

    def _close_batch(self, batch: _PendingBatch, generation_s: float) -> None:
        """Show the controller the batch's response lengths and put its ``BatchEnd``."""
        controller = self._inputs.controller
        lengths = tuple(len(s.response_ids) for row in batch.slots for s in row if s is not None)
        if lengths:  # a batch whose every prompt failed (e.g. every agent timed out) shows nothing
            controller.observe(lengths)
        carry = self._inputs.carry_over
        if carry is not None:
            carry.close_batch()
        self._put(
            BatchEnd(
                step=batch.step,
                group_size=batch.group_size,
                response_lengths=lengths,
                groups_produced=len(batch.items),
                groups_dropped=batch.dropped,
                source_state=batch.source_state,
                generation_s=generation_s,
                reward_s=self._reward_s,
                control_metrics={
                    **controller.metrics(),
                    **(batch.oversample.metrics() if batch.oversample else {}),
                    **(carry.metrics() if carry is not None else {}),
                },
                controller_state=controller.state_dict(),
                distill_metrics={} if self._inputs.teacher is None else self._inputs.teacher.batch_metrics(),
            )
        )

    def _drop_failed_group(self, batch: _PendingBatch, failed: FailedGroup) -> None:
        """Give up a prompt the generator could not start: its (prompt, k) slots are answered by
        one empty, not-kept group (``failed_group``)."""
        p, record = failed.prompt_index, batch.items[failed.prompt_index].record
        for k in range(batch.group_size):
            if batch.where.pop(batch.request.request_id(p, k), None) is None:
                raise RuntimeError(f"failed group {failed.base!r}: trajectory {k} was already answered")
        group = failed_group(step=batch.step, prompt_index=p, prompt_id=record.prompt_id)
        if batch.oversample is None:
            self._put(group)
        else:
            self._emit(batch, group)

    def _accept(self, batch: _PendingBatch, trajectory: Trajectory) -> None:
        """Check one trajectory and submit its reward; put the groups scored so far (``_harvest``)."""
        carry = self._inputs.carry_over
        if trajectory.request_id in batch.aborted:  # over-sampling: answered after (or by) its abort
            if carry is not None:
                carry.answered(trajectory.prompt_index, trajectory)
            return
        if trajectory.request_id not in batch.where:
            raise RuntimeError(f"the generator yielded an unknown or duplicate trajectory {trajectory.request_id!r}")
        p, k = batch.where.pop(trajectory.request_id)
        if carry is not None:
            batch.finished[(p, k)] = trajectory
        batch.scoring.append((p, k, trajectory, self._reward(batch.items[p].record, trajectory)))
        self._harvest(batch, wait=False)
        if self._inputs.teacher is not None:
            for group in self._inputs.teacher.ready():
                self._put(group)

    def _reward(self, record: Any, trajectory: Trajectory) -> Future:
        """The environment's reward when the trajectory has one, else the task reward of its last
        text (a reward pool's ``submit`` when it has one: scored off this thread)."""
        future: Future = Future()
        if trajectory.reward is not None:
            future.set_result(trajectory.reward)
            return future
        start, reward_fn = time.perf_counter(), self._inputs.reward_fn
        submit = getattr(reward_fn, "submit", None)
        if submit is not None:
            future = submit(record, trajectory.last_text)
        else:
            future.set_result(reward_fn(record, trajectory.last_text))
        self._reward_s += time.perf_counter() - start
        return future

    def _harvest(self, batch: _PendingBatch, *, wait: bool) -> None:
        """Place every scored sample (with ``wait``: until none is left), in submission order."""
        while batch.scoring:
            if wait:
                start = time.perf_counter()
                wait_futures([t[3] for t in batch.scoring], timeout=self._poll_s, return_when=FIRST_COMPLETED)
                self._reward_s += time.perf_counter() - start
                if self._stop.is_set():
                    raise _Stopped
            finished = [t[3].done() for t in batch.scoring]  # one look per future: it may finish meanwhile
            done = [t for t, f in zip(batch.scoring, finished, strict=True) if f]
            batch.scoring = [t for t, f in zip(batch.scoring, finished, strict=True) if not f]
            for p, k, trajectory, future in done:
                self._place(batch, p, k, sample_from(trajectory, batch.items[p], float(future.result())))
            if not wait:
                return

    def _place(self, batch: _PendingBatch, p: int, k: int, sample: Sample) -> None:
        """Store one scored sample; put its group on the queue if it completed the group."""
        if batch.oversample is not None and batch.oversample.state[p] == ABORTED:
            return
        batch.slots[p][k] = sample
        if all(s is not None for s in batch.slots[p]):
            self._emit(batch, self._score(batch.step, p, batch.slots[p]))

    def _emit(self, batch: _PendingBatch, group: ScoredGroup) -> None:
        """Put a finished group, or with over-sampling hand it over and put / abort what is decided."""
        if batch.oversample is None:
            batch.dropped += not group.kept
            self._put_group(group)
            return
        batch.oversample.finished(group)
        settled = batch.oversample.settle()
        for p in settled.abort:
            self._abort_prompt(batch, p)
        for decided in settled.groups:
            self._put_group(decided)
        batch.dropped = batch.oversample.state.count(DROPPED)

    def _put_group(self, group: ScoredGroup) -> None:
        if self._inputs.teacher is None:
            self._put(group)
        else:  # on-policy distillation: put once the teacher has scored it (_accept, _drain_teacher)
            self._inputs.teacher.submit(group)

    def _abort_prompt(self, batch: _PendingBatch, p: int) -> None:
        """Over-sampling: abort prompt ``p``'s unanswered requests; put it as an empty, not-kept group."""
        ids = [rid for k in range(batch.group_size) if (rid := batch.request.request_id(p, k)) in batch.where]
        for rid in ids:
            del batch.where[rid]
        batch.aborted.update(ids)
        if self._inputs.carry_over is not None:
            finished = {k: t for (q, k), t in batch.finished.items() if q == p}
            self._inputs.carry_over.aborted(p, batch.items[p], finished)
        self._inputs.engine.abort(ids)
        self._put(failed_group(step=batch.step, prompt_index=p, prompt_id=batch.items[p].record.prompt_id))

    def _drain_teacher(self) -> None:
        """Put every group still with the teacher (its added time per step: ``distill/teacher_wait_s``)."""
        if self._inputs.teacher is None:
            return
        groups = self._inputs.teacher.drain(self._stop, self._poll_s)
        if groups is None:
            raise _Stopped
        for group in groups:
            self._put(group)

    def _score(self, step: int, p: int, samples: Sequence[Sample]) -> ScoredGroup:
        """``score_group`` with overlong shaping measured the generator's way."""
        scoring, lengths = self._inputs.scoring, None
        if scoring.overlong is not None:
            measured = self._inputs.generator.overlong_lengths(samples, scoring.overlong.max_len)
            scoring = replace(scoring, overlong=replace(scoring.overlong, max_len=measured.max_len))
            lengths = measured.lengths
        return score_group(step=step, prompt_index=p, samples=samples, scoring=scoring, lengths=lengths)

    def _put(self, item: QueueItem) -> None:
        if self._record is not None:
            self._record(item)  # rollout.record: the queue as JSONL (pipeline.recording)
        if not put_unless_stopped(self._out, item, self._stop, self._poll_s):
            raise _Stopped
