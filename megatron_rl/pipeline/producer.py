"""The producer thread: prompts -> G requests each -> engine -> rewards -> scored groups -> queue.

Per batch i (step = start_step + i) the thread
1. waits until the engine has loaded the version the ``VersionSchedule`` requires,
2. asks the controller for G and the prompt source for the batch's prompts, and puts a
   ``BatchStart``,
3. sends every (prompt, k) request to the engine in one ``generate`` call (seeded per request,
   see ``records.request_seed``),
4. submits each result's reward as it completes (``reward_fn.submit`` when it has one, e.g. a
   ``rewards.RewardPool`` scoring in worker processes, else called in this thread); when a
   prompt's G samples are scored, shapes the rewards, computes the group's advantages and
   dynamic-sampling verdict and puts the ``ScoredGroup`` on the bounded queue (blocking while
   it is full); ``BatchEnd.reward_s`` is the time this thread spent in or waiting for rewards,
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
from typing import Any, Protocol

import torch

from megatron_rl.algorithms import AdvantageScale, dynamic_sampling_keep, group_advantages, overlong_reward_delta
from megatron_rl.config.fields import require_values
from megatron_rl.config.schema import AdvantageConfig, AlgorithmConfig
from megatron_rl.control import GroupSizeController
from megatron_rl.pipeline.records import (
    BatchEnd,
    BatchStart,
    QueueItem,
    Sample,
    ScoredGroup,
    put_unless_stopped,
    request_id,
    request_seed,
)
from megatron_rl.pipeline.versions import PolicyVersions, VersionSchedule
from megatron_rl.rollout.types import GenerationRequest, GenerationResult, RolloutEngine, SamplingSettings


class PromptRecordLike(Protocol):
    """What the pipeline needs of a prompt record (``data.PromptRecord`` fits)."""

    @property
    def prompt_id(self) -> str: ...


class PromptItem(Protocol):
    """A record and its prompt token ids (``data.TokenizedPrompt`` fits)."""

    @property
    def record(self) -> PromptRecordLike: ...

    @property
    def token_ids(self) -> tuple[int, ...]: ...


class PromptSource(Protocol):
    """Yields the prompts of each step (``data.PromptStream`` fits; ``state_dict`` is optional)."""

    def next_batch(self) -> Sequence[PromptItem]: ...


RewardCallable = Callable[[Any, str], float]  # (record, decoded response) -> reward; rewards.RewardFn fits
Detokenize = Callable[[Sequence[int]], str]  # response token ids -> text


@dataclass(frozen=True, kw_only=True)
class OverlongShaping:
    """DAPO soft overlong punishment added to the task reward (``overlong_reward_delta``)."""

    max_len: int
    buffer: int
    penalty: float = 1.0


@dataclass(frozen=True, kw_only=True)
class GroupScoring:
    """How a finished group is scored."""

    advantage_scale: AdvantageScale = AdvantageConfig.scale  # "group" (GRPO) or "none" (Dr.GRPO); not "batch"
    dynamic_sampling: bool = AlgorithmConfig.dynamic_sampling  # DAPO: drop groups whose rewards are all equal
    overlong: OverlongShaping | None = None
    eps: float = AdvantageConfig.eps  # added to the group std before dividing (algorithm.advantage.eps)

    def __post_init__(self) -> None:
        # the config's rules: groups are scored as they complete, so 'batch' is refused
        require_values({"algorithm.advantage.scale": self.advantage_scale, "algorithm.advantage.eps": self.eps})


def score_group(
    *,
    step: int,
    prompt_index: int,
    samples: Sequence[Sample],
    scoring: GroupScoring,
    lengths: Sequence[int] | None = None,
) -> ScoredGroup:
    """Shaped rewards ``[G]``, advantages ``[G]`` and the dynamic-sampling verdict of one group;
    ``lengths``: what overlong shaping measures (default: each response's length)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    if scoring.overlong is not None:
        lengths = torch.tensor([len(s.response_ids) for s in samples] if lengths is None else list(lengths))
        o = scoring.overlong
        rewards = rewards + overlong_reward_delta(lengths, max_len=o.max_len, buffer=o.buffer, penalty=o.penalty)
    kept = bool(dynamic_sampling_keep(rewards[None])[0]) if scoring.dynamic_sampling else True
    return ScoredGroup(
        step=step,
        prompt_index=prompt_index,
        prompt_id=samples[0].prompt_id,
        samples=tuple(samples),
        rewards=rewards,
        kept=kept,
        advantages=group_advantages(rewards[None], scale=scoring.advantage_scale, eps=scoring.eps)[0],
    )


class _Stopped(Exception):
    """Internal: unwinds the producer after ``stop()``."""


@dataclass(kw_only=True)
class _PendingBatch:
    """Bookkeeping of the batch being generated."""

    step: int
    items: Sequence[PromptItem]
    group_size: int
    where: dict[str, tuple[int, int]]  # request id -> (prompt index, k), removed when answered
    slots: list[list[Sample | None]]
    dropped: int = 0
    scoring: list[tuple[int, int, GenerationResult, Future]] = field(default_factory=list)  # (p, k, result, reward)


class Producer:
    """Background thread feeding ``out`` with ``ScoredGroup``s and one ``BatchEnd`` per step."""

    def __init__(
        self,
        *,
        engine: RolloutEngine,
        prompts: PromptSource,
        reward_fn: RewardCallable,
        detokenize: Detokenize,
        controller: GroupSizeController,
        versions: PolicyVersions,
        schedule: VersionSchedule,
        sampling: SamplingSettings,
        scoring: GroupScoring,
        out: queue.Queue[QueueItem],
        start_step: int,
        num_steps: int,
        seed: int,
        poll_s: float,
        record: Callable[[QueueItem], None] | None = None,
    ) -> None:
        self._engine, self._prompts, self._reward_fn, self._detokenize = engine, prompts, reward_fn, detokenize
        self._controller = controller
        self._versions, self._schedule, self._sampling, self._scoring = versions, schedule, sampling, scoring
        self._out, self._seed, self._poll_s, self._record = out, seed, poll_s, record
        self._start_step, self._num_steps = start_step, num_steps
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
            for i in range(self._num_steps):
                self._produce_batch(i)
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 -- handed to the consumer, which re-raises it
            self._error = exc

    def _open_batch(self, i: int) -> tuple[_PendingBatch, list[PromptItem], int, Mapping[str, Any] | None]:
        """Wait for batch ``i``'s weights, choose G, draw its prompts and put its ``BatchStart``:
        (pending batch, prompts, G, the prompt source's state before the draw)."""
        if not self._versions.wait_for(self._schedule.required_version(i), self._stop, self._poll_s):
            raise _Stopped
        group_size = self._controller.choose()
        items = list(self._prompts.next_batch())
        state_fn = getattr(self._prompts, "state_dict", None)
        source_state: Mapping[str, Any] | None = state_fn() if callable(state_fn) else None
        batch = self._new_batch(self._start_step + i, items, group_size)
        self._put(BatchStart(step=batch.step, num_prompts=len(items), group_size=group_size))
        return batch, items, group_size, source_state

    def _close_batch(
        self,
        batch: _PendingBatch,
        num_prompts: int,
        group_size: int,
        source_state: Mapping[str, Any] | None,
        generation_s: float,
    ) -> None:
        """Show the controller the batch's response lengths and put its ``BatchEnd``."""
        lengths = tuple(len(s.response_ids) for row in batch.slots for s in row if s is not None)
        self._controller.observe(lengths)
        self._put(
            BatchEnd(
                step=batch.step,
                group_size=group_size,
                response_lengths=lengths,
                groups_produced=num_prompts,
                groups_dropped=batch.dropped,
                source_state=source_state,
                generation_s=generation_s,
                reward_s=self._reward_s,
                control_metrics=dict(self._controller.metrics()),
                controller_state=self._controller.state_dict(),
            )
        )

    def _produce_batch(self, i: int) -> None:
        batch, items, group_size, source_state = self._open_batch(i)
        requests = [
            self._request(batch.step, it.record.prompt_id, it.token_ids, k) for it in items for k in range(group_size)
        ]
        start, self._reward_s = time.perf_counter(), 0.0
        for result in self._engine.generate(requests):
            if self._stop.is_set():
                raise _Stopped
            self._accept(i, batch, result)
        self._harvest(batch, wait=True)
        if batch.where:
            missing = next(iter(batch.where))
            raise RuntimeError(f"engine returned no result for {len(batch.where)} requests, e.g. {missing!r}")
        self._close_batch(batch, len(items), group_size, source_state, time.perf_counter() - start)

    def _new_batch(self, step: int, items: Sequence[PromptItem], group_size: int) -> _PendingBatch:
        where: dict[str, tuple[int, int]] = {}
        for p, item in enumerate(items):
            for k in range(group_size):
                rid = request_id(step, item.record.prompt_id, k)
                if rid in where:
                    raise ValueError(f"prompt_id {item.record.prompt_id!r} appears twice in the batch of step {step}")
                where[rid] = (p, k)
        return _PendingBatch(
            step=step, items=items, group_size=group_size, where=where, slots=[[None] * group_size for _ in items]
        )

    def _request(self, step: int, prompt_id: str, prompt_ids: Sequence[int], k: int) -> GenerationRequest:
        sampling = replace(self._sampling, seed=request_seed(self._seed, step, prompt_id, k))
        return GenerationRequest(
            request_id=request_id(step, prompt_id, k), prompt_ids=tuple(prompt_ids), sampling=sampling
        )

    def _accept(self, i: int, batch: _PendingBatch, result: GenerationResult) -> None:
        """Check one result and submit its reward; put the groups scored so far (``_harvest``)."""
        if result.request_id not in batch.where:
            raise RuntimeError(f"engine returned an unknown or duplicate request id {result.request_id!r}")
        p, k = batch.where.pop(result.request_id)
        self._schedule.check_sample(i, result.weight_version, result.request_id)
        start = time.perf_counter()
        batch.scoring.append((p, k, result, self._submit(batch.items[p].record, result.response_ids)))
        self._reward_s += time.perf_counter() - start
        self._harvest(batch, wait=False)

    def _submit(self, record: Any, response_ids: Sequence[int]) -> Future:
        text = self._detokenize(response_ids)
        submit = getattr(self._reward_fn, "submit", None)
        if submit is not None:
            return submit(record, text)
        future: Future = Future()
        future.set_result(self._reward_fn(record, text))
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
            for p, k, result, future in done:
                self._place(batch, p, k, result, float(future.result()))
            if not wait:
                return

    def _place(self, batch: _PendingBatch, p: int, k: int, result: GenerationResult, reward: float) -> None:
        """Store one scored sample; put its group on the queue if it completed the group."""
        record = batch.items[p].record
        batch.slots[p][k] = Sample(
            prompt_id=record.prompt_id,
            request_id=result.request_id,
            index=k,
            prompt_ids=tuple(batch.items[p].token_ids),
            response_ids=result.response_ids,
            behav_logprobs=result.logprobs,
            weight_version=result.weight_version,
            finish_reason=result.finish_reason,
            reward=reward,
            routed_experts=result.routed_experts,
        )
        if all(s is not None for s in batch.slots[p]):
            group = score_group(step=batch.step, prompt_index=p, samples=batch.slots[p], scoring=self._scoring)
            batch.dropped += not group.kept
            self._put(group)

    def _put(self, item: QueueItem) -> None:
        if self._record is not None:
            self._record(item)  # rollout.record: the queue as JSONL (pipeline.recording)
        if not put_unless_stopped(self._out, item, self._stop, self._poll_s):
            raise _Stopped
