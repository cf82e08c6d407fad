"""One step's groups -> mini-batches (by prompt order) -> micro-batches (by token budget).

Mini-batch membership is decided by the batch's prompt order, never by arrival: with
``num_mini_batches = m`` and ``n`` prompts, prompt ``p`` belongs to mini-batch ``p // (n / m)``.
Each mini-batch ends with one optimizer step, so the update does not depend on which
engine finished first: ``periodic`` (groups trained as they arrive) equals ``sync`` (the
whole batch received first, then packed in prompt order) because, inside a mini-batch,
gradient accumulation is a sum.

``periodic`` / ``stale`` (``streamed``): mini-batch j is trained while it arrives; groups of
later mini-batches that complete early wait in a buffer (they must see the weights after
step j). A micro-batch is cut when the next group would overflow the token budget, or when
the queue is momentarily empty (``flush_when_idle``), so training overlaps generation.

Data parallelism (``replicas`` > 1): every kept group is given, when it is cut into the
mini-batch, to the replica with the fewest packed tokens so far this step
(``dispatch.TokenRouter``), and micro-batches are packed per replica (``MicroBatch.replica``).
Which replica trains a group changes only where its gradient is summed, not the sum.

Expert parallelism (``lockstep``, ``parallel.ep`` > 1): the EP groups span DP replicas and every
MoE layer runs EP collectives (megatron's token dispatcher), so the replicas must run the same
number of forward/backward passes per optimizer step, in the same order: a replica with one more
micro-batch would wait inside an MoE layer for peers already in the optimizer step. The
micro-batches then go out in rounds, one per replica (replica 0, rank 0's own, last), and a
replica short of micro-batches at the end of a mini-batch gets padding ones
(``padding_micro_batch``: one sample cut to two tokens, loss mask 0): they run the MoE layers'
collectives and add exactly zero to the loss, its denominator and every gradient. A round goes
out only when every replica has its micro-batch, so no replica waits inside a collective for
groups still being generated.

The caller iterates ``StepBatch.mini_batches()`` in order and each mini-batch to its end
before the next; a mini-batch whose groups were all dropped (dynamic sampling) yields no
micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from megatron_rl.pipeline.dispatch import TokenRouter
from megatron_rl.pipeline.records import (
    BatchEnd,
    BatchStart,
    MicroBatch,
    QueueItem,
    ScoredGroup,
    chunk_by_tokens,
    make_micro_batch,
    split_group,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchCutting:
    """How a step's groups are cut: mini-batches, the micro-batch token budget, streaming, DP routing."""

    mini_batches: int  # trainer.mini_batches: optimizer steps per batch
    token_budget: int  # pipeline.micro_batch_tokens
    streamed: bool  # periodic / stale: mini-batch j is trained while it arrives (module doc)
    flush_when_idle: bool  # cut a partial micro-batch when the queue is momentarily empty
    replicas: int = 1  # DP replicas the groups are routed to
    lockstep: bool = False  # every replica trains as many micro-batches per mini-batch (expert parallelism)


class StepBatch:
    """The groups of one step as the consumer pops them, cut into mini- and micro-batches."""

    def __init__(
        self,
        start: BatchStart,
        policy_version: int,
        cutting: BatchCutting,
        *,
        pop: Callable[[], QueueItem],
        queue_empty: Callable[[], bool],
    ) -> None:
        """``pop``: the next queue item of the step (blocking); ``queue_empty``: whether a pop
        would wait now (``BatchCutting.flush_when_idle``)."""
        num_mini_batches, replicas = cutting.mini_batches, cutting.replicas
        m, n = num_mini_batches, start.num_prompts
        if n % m:
            raise ValueError(
                f"step {start.step}: {n} prompts cannot be split into trainer.mini_batches={m} equal mini-batches"
            )
        self.start, self.step, self.policy_version = start, start.step, policy_version
        self.num_mini_batches, self._per_mini = m, n // m
        self._budget, self._streamed = cutting.token_budget, cutting.streamed
        self._flush_when_idle = cutting.flush_when_idle
        self._pop, self._queue_empty = pop, queue_empty
        self.groups: list[ScoredGroup] = []  # every group of the step, in arrival order
        self.end: BatchEnd | None = None
        self._seen = [0] * m  # groups received per mini-batch (dropped ones included)
        self._waiting: list[list[ScoredGroup]] = [[] for _ in range(m)]  # kept, for a later mini-batch
        self.num_micro_batches = 0
        self.overlapped_micro_batches = 0  # handed out while groups of the step were still generating
        self._next_mini = 0
        self.router = TokenRouter(replicas)  # which DP replica trains each group
        self.lockstep = cutting.lockstep and replicas > 1
        self._held: list[list[MicroBatch]] = [[] for _ in range(replicas)]  # lockstep: cut, not yet sent
        self.padding_micro_batches = 0  # lockstep: padding handed out this step

    def mini_batches(self) -> Iterator[Iterator[MicroBatch]]:
        """``num_mini_batches`` iterators of micro-batches, in prompt order (see the module doc)."""
        if not self._streamed:
            self.finish()  # sync: the whole batch first
        for j in range(self.num_mini_batches):
            if self._next_mini != j:
                raise RuntimeError(f"mini-batch {self._next_mini - 1} of step {self.step} was not trained to its end")
            yield self._streamed_mini(j) if self._streamed else self._synced_mini(j)

    def finish(self) -> BatchEnd:
        """Pop up to the step's ``BatchEnd`` (after the last mini-batch) and return it."""
        while self.end is None:
            self._receive()
        return self.end

    def mini_batch_of(self, group: ScoredGroup) -> int:
        return group.prompt_index // self._per_mini

    # -- receiving ---------------------------------------------------------------------------
    def _receive(self) -> ScoredGroup | None:
        """Pop one item of this step; a group is recorded and returned, the end marker stored."""
        item = self._pop()
        if item.step != self.step or isinstance(item, BatchStart):
            raise RuntimeError(
                f"consumer expected a group of step {self.step}, got {type(item).__name__} of step {item.step}"
            )
        if isinstance(item, BatchEnd):
            if sum(self._seen) != self.start.num_prompts:
                raise RuntimeError(f"step {self.step} ended after {sum(self._seen)} of {self.start.num_prompts} groups")
            self.end = item
            return None
        self.groups.append(item)
        self._seen[self.mini_batch_of(item)] += 1
        return item

    def _generating(self) -> bool:
        return sum(self._seen) < self.start.num_prompts

    # -- cutting ----------------------------------------------------------------------------
    def _synced_mini(self, j: int) -> Iterator[MicroBatch]:
        """sync: the kept groups of mini-batch j in prompt order, packed under the budget."""
        kept = sorted((g for g in self.groups if g.kept and self.mini_batch_of(g) == j), key=lambda g: g.prompt_index)
        routed: list[list[ScoredGroup]] = [[] for _ in range(self.router.replicas)]
        for group in kept:
            routed[self.router.assign(group.num_packed_tokens)].append(group)
        for r in reversed(range(self.router.replicas)):  # replica 0 (rank 0's own) last: the others start first
            for chunk in chunk_by_tokens(routed[r], self._budget):
                yield from self._out(self._micro_batch(chunk, j, r))
        yield from self._end_mini()
        self._next_mini = j + 1

    def _streamed_mini(self, j: int) -> Iterator[MicroBatch]:
        """periodic / stale: mini-batch j's groups as they arrive (earlier arrivals first)."""
        bufs: list[list[ScoredGroup]] = [[] for _ in range(self.router.replicas)]  # per replica
        pending, self._waiting[j] = self._waiting[j], []
        while pending or self._seen[j] < self._per_mini:
            group = pending.pop(0) if pending else self._receive()
            if group is None or not group.kept:
                continue
            if self.mini_batch_of(group) != j:
                self._waiting[self.mini_batch_of(group)].append(group)
                continue
            r = self.router.assign(group.num_packed_tokens)
            for part in split_group(group, self._budget):
                if bufs[r] and sum(g.num_packed_tokens for g in bufs[r]) + part.num_packed_tokens > self._budget:
                    yield from self._out(self._micro_batch(bufs[r], j, r))
                    bufs[r] = []
                bufs[r].append(part)
            if not pending and self._flush_when_idle and self._queue_empty():
                yield from self._flush(bufs, j)
        yield from self._flush(bufs, j)
        yield from self._end_mini()
        self._next_mini = j + 1

    def _flush(self, bufs: list[list[ScoredGroup]], j: int) -> Iterator[MicroBatch]:
        """A micro-batch of each replica's non-empty buffer (emptied); replica 0 (rank 0's own) last."""
        for r in reversed(range(len(bufs))):
            if buf := bufs[r]:
                bufs[r] = []
                yield from self._out(self._micro_batch(buf, j, r))

    def _micro_batch(self, groups: list[ScoredGroup], j: int, replica: int = 0) -> MicroBatch:
        self.num_micro_batches += 1
        self.overlapped_micro_batches += self._generating()
        return make_micro_batch(groups, policy_version=self.policy_version, mini_batch=j, replica=replica)

    # -- lockstep (expert parallelism) ---------------------------------------------------------
    def _out(self, mb: MicroBatch) -> Iterator[MicroBatch]:
        """``mb`` at once; in lockstep, held until every replica has one, then the round."""
        if not self.lockstep:
            yield mb
            return
        self._held[mb.replica].append(mb)
        while all(self._held):
            yield from self._round()

    def _round(self) -> Iterator[MicroBatch]:
        """One held micro-batch per replica (padding where a replica has none), replica 0 last."""
        real = next(h[0] for h in self._held if h)
        for r in reversed(range(len(self._held))):
            if self._held[r]:
                yield self._held[r].pop(0)
            else:
                self.padding_micro_batches += 1
                yield padding_micro_batch(
                    real.groups[0], policy_version=self.policy_version, mini_batch=real.mini_batch, replica=r
                )

    def _end_mini(self) -> Iterator[MicroBatch]:
        """Lockstep: the rest of the mini-batch's rounds, short replicas padded."""
        while any(self._held):
            yield from self._round()


def padding_micro_batch(template: ScoredGroup, *, policy_version: int, mini_batch: int, replica: int) -> MicroBatch:
    """A micro-batch that trains nothing: ``template``'s first sample cut to its first prompt
    token and first response token (its routes likewise, for routing replay), loss mask 0 and
    advantage 0. Its forward/backward runs every collective of the model (the MoE layers' EP
    all-to-all) and adds exactly zero to the loss, its denominator and every gradient."""
    s = template.samples[0]
    routes = s.routed_experts
    if routes is not None:
        routes = dataclasses.replace(routes, indices=routes.indices[:1])  # the one forwarded token
    sample = dataclasses.replace(
        s,
        prompt_ids=s.prompt_ids[:1],
        response_ids=s.response_ids[:1],
        behav_logprobs=s.behav_logprobs[:1],
        teacher_logprobs=None if s.teacher_logprobs is None else s.teacher_logprobs[:1],
        loss_mask=(0,),
        routed_experts=routes,
    )
    group = ScoredGroup(
        step=template.step,
        prompt_index=template.prompt_index,
        prompt_id=template.prompt_id,
        samples=(sample,),
        rewards=torch.zeros(1),
        advantages=torch.zeros(1),
        kept=True,
    )
    return make_micro_batch([group], policy_version=policy_version, mini_batch=mini_batch, replica=replica)


def is_padding(mb: MicroBatch) -> bool:
    """True for a ``padding_micro_batch`` (no token carries a loss term)."""
    return mb.loss_mask is not None and not bool(mb.loss_mask.any())
