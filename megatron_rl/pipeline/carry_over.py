"""Partial rollout's carry-over (``rollout.carry_over``): what DAPO over-sampling aborts in one batch
continues in the next, with the tokens it already has (slime's partial rollout).

Over-sampling (``pipeline.oversample``) aborts the prompts a batch cannot train once it has its
target of kept groups. Without carry-over their tokens are thrown away. With it, each aborted
prompt keeps what it had: its finished trajectories and, for each request the abort cut short,
the tokens, behaviour log-probs and per-token versions the engine had sampled (an ``"abort"``
result). The next batch puts the carried prompts first (prompt order decides which kept groups
train: carried prompts get the first chance, so a prompt is not carried again and again), then
the prompts it draws; its generator yields a carried finished trajectory as it is and continues a
carried partial one from its tokens (``generation.SingleTurnGenerator``). A group is scored and
trained only once all its G trajectories are complete, in the batch that completes it; in the
batch that aborted it, it is an empty, not-kept group as before.

Bounds:
- at most ``max_prompts`` prompts are carried, the first aborted in prompt order, rounded down to
  a multiple of ``multiple`` (the mini-batch count: a batch's prompts split into equal
  mini-batches); the other aborted prompts are lost, as without carry-over;
- bounded staleness: a carried trajectory whose first token's version is older than the next
  batch's oldest allowed version (``VersionSchedule.required_version``) is dropped and that
  (p, k) generated again from its prompt (``partial/carried_restarted``), so the schedule's bound
  on every trained token holds. With ``max_staleness`` 1 tokens survive only when the engine
  already ran the next batch's version (in-flight updates); with 2 most do.

Carried prompts exist only in the producer: a checkpoint does not hold them, so a resumed run
starts without the prompts its last batch aborted (they were not trained; nothing trained is lost).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from megatron_rl.generation.base import PromptItem, Trajectory


@dataclass
class _Aborted:
    """One aborted prompt of the batch being generated: what it has of each k so far."""

    item: PromptItem
    trajectories: dict[int, Trajectory] = field(default_factory=dict)


@dataclass(frozen=True)
class CarriedBatch:
    """What the next batch takes over: its first prompts and their trajectories by (p, k)."""

    items: tuple[PromptItem, ...] = ()
    trajectories: Mapping[tuple[int, int], Trajectory] = field(default_factory=dict)


class CarryOver:
    """The producer's carry-over between consecutive batches (module doc)."""

    def __init__(self, *, max_prompts: int, multiple: int) -> None:
        if max_prompts < 0 or multiple < 1:
            raise ValueError(f"carry-over of {max_prompts} prompts in multiples of {multiple}")
        self.max_prompts, self.multiple = max_prompts, multiple
        self._aborted: dict[int, _Aborted] = {}  # prompt index in the current batch -> what it has
        self._next: list[_Aborted] = []
        self._counts = dict.fromkeys(("prompts", "requests", "tokens", "restarted", "finished"), 0)

    def aborted(self, p: int, item: PromptItem, finished: Mapping[int, Trajectory]) -> None:
        """Prompt ``p`` of the current batch was aborted with ``finished`` trajectories (by k)."""
        self._aborted[p] = _Aborted(item=item, trajectories=dict(finished))

    def answered(self, p: int, trajectory: Trajectory) -> None:
        """An aborted prompt's request answered after its abort (its tokens so far, or finished)."""
        if trajectory.response_ids or trajectory.finish_reason != "abort":
            self._aborted[p].trajectories[trajectory.k] = trajectory

    def close_batch(self) -> None:
        """The current batch ended: keep its first aborted prompts (prompt order, module doc)."""
        keep = min(len(self._aborted), self.max_prompts) // self.multiple * self.multiple
        self._next = [self._aborted[p] for p in sorted(self._aborted)[:keep]]
        self._aborted = {}

    def take(self, min_version: int) -> CarriedBatch:
        """The prompts carried into the batch that opens now, whose oldest allowed version is
        ``min_version``: trajectories that started before it are dropped (module doc)."""
        items, trajectories = [], {}
        for p, prompt in enumerate(self._next):
            items.append(prompt.item)
            for k, t in prompt.trajectories.items():
                if t.turn_versions[0] < min_version:
                    self._counts["restarted"] += 1
                    continue
                trajectories[(p, k)] = t
                self._count(t)
        self._counts["prompts"] += len(items)
        self._next = []
        return CarriedBatch(items=tuple(items), trajectories=trajectories)

    def _count(self, t: Trajectory) -> None:
        if t.finish_reason == "abort":
            self._counts["requests"] += 1
        else:
            self._counts["finished"] += 1
        self._counts["tokens"] += len(t.response_ids)

    def metrics(self) -> dict[str, float]:
        """``partial/carried_*`` of the batch opened last, then reset: prompts carried, partial
        requests continued, finished trajectories reused, tokens kept, trajectories restarted."""
        out = {f"partial/carried_{name}": float(n) for name, n in self._counts.items()}
        self._counts = dict.fromkeys(self._counts, 0)
        return out


def batch_prompts(carried: Sequence[PromptItem], drawn: Sequence[PromptItem]) -> tuple[PromptItem, ...]:
    """A batch's prompts: the carried ones first, then the drawn ones. A carried prompt the draw
    also holds (a small data set's next epoch) is renamed ``<prompt_id>@carried``: a batch's prompt
    ids name its groups, requests and seeds, so they must differ."""
    drawn_ids = {item.record.prompt_id for item in drawn}
    out = []
    for item in carried:
        if item.record.prompt_id in drawn_ids:
            record = dataclasses.replace(item.record, prompt_id=f"{item.record.prompt_id}@carried")
            item = dataclasses.replace(item, record=record)
        out.append(item)
    return (*out, *drawn)
