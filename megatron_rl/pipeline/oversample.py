"""DAPO over-sampling of one batch: which finished groups are trained, which prompts to abort.

The batch draws D prompts for a target of N trained groups (``algorithm.oversample``). The trained
groups are the first N in prompt order that dynamic sampling keeps, exactly as if every prompt had
been generated to its end: timing never changes them, so a run is reproducible and the pipeline
modes agree. Once the prompts before prompt p hold N kept groups, p cannot be trained: if it is
still generating it is aborted (``WorkerPool.abort``), if it finished kept it is surplus (put as
not kept). A kept group is put as trained as soon as it is sure to be among the first N (the kept
groups before it plus the prompts before it still generating are fewer than N), so ``periodic``
trains it while the rest generates.

``Oversampler`` is that bookkeeping, pure: the producer tells it each finished group and asks
``settle`` what to put and what to abort. Every prompt ends with exactly one group put: trained,
not kept (dynamic sampling), surplus, or aborted (an empty group, like ``scoring.failed_group``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_rl.pipeline.records import ScoredGroup

# A prompt's state: generating, finished and not put yet, or put as one of the four outcomes.
RUNNING, WAITING, TRAINED, DROPPED, SURPLUS, ABORTED = "running", "waiting", "trained", "dropped", "surplus", "aborted"


@dataclass(frozen=True, kw_only=True)
class Settled:
    """What ``Oversampler.settle`` decided: groups to put now (prompt order), prompts to abort."""

    groups: tuple[ScoredGroup, ...]
    abort: tuple[int, ...]


@dataclass(kw_only=True)
class Oversampler:
    """Over-sampling state of one batch of ``num_prompts`` prompts training ``target`` groups."""

    target: int  # N: kept groups the batch trains at most
    num_prompts: int  # D: prompts drawn
    state: list[str] = field(init=False)
    waiting: dict[int, ScoredGroup] = field(default_factory=dict)  # finished groups not put yet

    def __post_init__(self) -> None:
        if not 1 <= self.target <= self.num_prompts:
            raise ValueError(f"over-sampling: target {self.target} groups of {self.num_prompts} prompts")
        self.state = [RUNNING] * self.num_prompts

    def finished(self, group: ScoredGroup) -> None:
        """Prompt ``group.prompt_index`` finished scoring."""
        p = group.prompt_index
        if self.state[p] != RUNNING:
            raise RuntimeError(f"over-sampling: prompt {p} finished while {self.state[p]}")
        self.state[p], self.waiting[p] = WAITING, group

    def settle(self) -> Settled:
        """Walk the prompts in order: put what is decided, abort what cannot be trained (module doc)."""
        put, abort = [], []
        kept = running = 0  # among the prompts before p: kept by dynamic sampling, still generating
        for p in range(self.num_prompts):
            if self.state[p] == RUNNING and kept >= self.target:
                abort.append(p)
                self.state[p] = ABORTED
            elif self.state[p] == WAITING:
                group = self.waiting[p]
                if not group.kept:
                    put.append(self._put(p, group, DROPPED))
                elif kept >= self.target:
                    put.append(self._put(p, dataclasses.replace(group, kept=False), SURPLUS))
                elif kept + running < self.target:
                    put.append(self._put(p, group, TRAINED))
            kept += self.state[p] in (TRAINED, SURPLUS) or (self.state[p] == WAITING and self.waiting[p].kept)
            running += self.state[p] == RUNNING
        return Settled(groups=tuple(put), abort=tuple(abort))

    def _put(self, p: int, group: ScoredGroup, outcome: str) -> ScoredGroup:
        del self.waiting[p]
        self.state[p] = outcome
        return group

    def metrics(self) -> dict[str, float]:
        """``control/*`` counters of the batch."""
        return {
            "control/oversample_prompts": float(self.num_prompts - self.target),
            "control/aborted_groups": float(self.state.count(ABORTED)),
            "control/surplus_groups": float(self.state.count(SURPLUS)),
        }
