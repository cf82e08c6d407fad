"""Dispatch keeps every group on one engine (``rollout.dispatch``, issue 30's mutation audit).

The G samples of a prompt share its KV cache in one engine, so ``_take_groups`` takes whole
groups only: about ``chunk`` requests per command, but a group larger than the chunk goes whole.
``test_rollout_remote``'s groups are exactly one chunk, so a ``_take_groups`` that split a larger
group passed it. Here groups are larger than, smaller than and equal to the chunk, on several
engines (chunked and streaming), driven through ``generate_results`` by a supervisor without
processes that answers one command per busy worker per wait.
"""

from __future__ import annotations

from collections import Counter, deque
from types import SimpleNamespace

import pytest

from megatron_rl.rollout.dispatch import _take_groups, generate_results, group_of
from megatron_rl.rollout.supervision import WorkerHandle
from megatron_rl.rollout.types import GenerationResult
from megatron_rl.rollout.worker import Done, Generate, Result
from tests.rollout_reference import request

MAX_BATCH = 4
# chunk = min(MAX_BATCH, ceil(36 requests / 3 engines)) = 4: groups of 6, 9 and 7 exceed it,
# 2, 1 and 3 are smaller, the two 4s equal it
GROUP_SIZES = (6, 2, 4, 9, 1, 4, 3, 7)


class _Recorder:
    """Stands in for a worker's sender thread: keeps every command sent."""

    def __init__(self) -> None:
        self.commands: list[Generate] = []

    def send(self, command: Generate) -> None:
        self.commands.append(command)


class _AnsweringSupervisor:
    """The parts of a ``Supervisor`` that ``generate_results`` uses; each wait answers one
    command of every busy worker (a streaming worker's newest first: its Dones come out of
    order), so workers free their slots at different times."""

    def __init__(self, n_workers: int, *, streaming: bool) -> None:
        self.version = 0
        self.gate = None  # Supervisor.gate: no in-flight updates
        self.workers = []
        for i in range(n_workers):
            w = WorkerHandle(SimpleNamespace(index=i, max_batch_size=MAX_BATCH), streaming=streaming)
            w.sender = _Recorder()
            self.workers.append(w)

    def next_events(self, workers, extra=()):
        """Yield ``(worker, Result)`` per request of one outstanding command, then its ``Done``."""
        for w in workers:
            ids = w.chunks[-1] if w.streaming else w.chunks[0]
            for rid in ids:
                r = w.in_flight[rid]
                yield w, Result(_echo(r))
            yield w, Done(ids)


def _echo(r) -> GenerationResult:
    return GenerationResult(
        request_id=r.request_id,
        prompt_ids=r.prompt_ids,
        response_ids=r.prompt_ids,
        logprobs=(0.0,) * len(r.prompt_ids),
        finish_reason="length",
        weight_version=0,
    )


def _requests(sizes=GROUP_SIZES):
    """Group j has ``sizes[j]`` requests ``0/p<j>/<k>``; prompt lengths differ so the
    fewest-outstanding-tokens choice moves between engines."""
    return [
        request(f"0/p{j}/{k}", (1,) * (3 + 5 * (j % 3)), max_new=8) for j, size in enumerate(sizes) for k in range(size)
    ]


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("n_workers", [2, 3])
def test_every_group_reaches_one_engine_whole_and_every_request_once(streaming, n_workers):
    reqs = _requests()
    sup = _AnsweringSupervisor(n_workers, streaming=streaming)
    results = list(generate_results(sup, reqs, max_batch_size=MAX_BATCH))
    assert Counter(r.request_id for r in results) == Counter(r.request_id for r in reqs)  # each answered once
    sent = [(w.spec.index, c) for w in sup.workers for c in w.sender.commands]
    dispatched = [r.request_id for _, c in sent for r in c.requests]
    assert Counter(dispatched) == Counter(r.request_id for r in reqs)  # each dispatched exactly once
    engines_of, commands_of = {}, {}
    for i, c in sent:
        for r in c.requests:
            engines_of.setdefault(group_of(r), set()).add(i)
            commands_of.setdefault(group_of(r), set()).add(id(c))
    assert all(len(e) == 1 for e in engines_of.values()), engines_of  # one engine per group
    assert all(len(c) == 1 for c in commands_of.values()), commands_of  # whole groups per command
    assert len({i for i, _ in sent}) == n_workers  # the groups did spread over the engines
    for _, c in sent:  # more than one group per command only while they fit the chunk
        assert len(c.requests) <= MAX_BATCH or len({group_of(r) for r in c.requests}) == 1


def test_take_groups_takes_a_larger_group_whole_and_packs_smaller_ones_to_the_chunk():
    pending = deque(_requests((6, 2, 1, 4, 3)))
    takes = []
    while pending:
        takes.append([group_of(r) for r in _take_groups(pending, 4)])
    assert [Counter(t) for t in takes] == [
        {"0/p0": 6},  # larger than the chunk: whole, alone
        {"0/p1": 2, "0/p2": 1},  # smaller ones while they fit (a 4 would not)
        {"0/p3": 4},  # exactly the chunk
        {"0/p4": 3},
    ]
