"""How context parallelism splits a packed micro-batch: per-segment zigzag, and the query runs.

Every segment of the layout (a prompt, or one response) is cut into ``2·cp`` chunks as equal as
integer lengths allow; CP rank ``r`` holds chunks ``r`` and ``2·cp-1-r`` of EVERY segment. Why per
segment and not a zigzag of the whole packed sequence: under the shared-prompt mask a query's
work is (prefix keys) + (its offset inside its own segment), so the causal part of the work is
balanced within each segment, not along the packed sequence; zigzag inside every segment gives
each rank the same share (±1 token per segment) of the tokens (linear / MLP work) and of the
causal work of every segment, whatever the mix of prompt and response lengths. The prompt-prefix
part (Lp keys for every response token) is then balanced by the token counts.

A rank's tokens, in packed order, form ``runs``: a run is contiguous query rows ``[a, b)`` inside
one segment that starts at ``s`` and whose group's prompt is ``[g, p)`` (``p = g`` for a prompt
segment). Its keys are ``[g, p) ++ [s, b)`` and the mask is bottom-right causal on that key list:
row ``a + i`` sees the prefix and own keys up to ``a + i``. That is the shared-prompt mask of
``layout`` restricted to the run's rows, and the form every CP backend consumes.

``CPSlice`` is built once per micro-batch (cached on the ``AttentionLayout``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.attention.layout import AttentionLayout


@dataclass(frozen=True, kw_only=True)
class QueryRun:
    """Contiguous query rows ``[start, end)`` of one segment; keys ``[prefix) ++ [seg_start, end)``."""

    start: int
    end: int
    seg_start: int
    prefix_start: int
    prefix_end: int  # == prefix_start for a prompt segment

    @property
    def num_keys(self) -> int:
        return self.prefix_end - self.prefix_start + self.end - self.seg_start


@dataclass(frozen=True, kw_only=True)
class Partition:
    """A split of ``n`` items over ``size`` ranks: ``index[r]`` are rank r's items (ascending)."""

    n: int
    index: tuple[torch.Tensor, ...]  # int64, one per rank

    @property
    def size(self) -> int:
        return len(self.index)

    @property
    def max_count(self) -> int:
        return max(int(ix.numel()) for ix in self.index)

    def slot(self) -> torch.Tensor:
        """``[n]``: where item t lies in the ranks' padded concatenation ``[size * max_count]``."""
        out = torch.empty(self.n, dtype=torch.int64)
        width = self.max_count
        for r, ix in enumerate(self.index):
            out[ix] = r * width + torch.arange(ix.numel())
        return out

    def restrict(self, items: torch.Tensor) -> Partition:
        """The partition of ``items`` (indices into this one's n) by owner, renumbered 0..len-1:
        rank r gets the positions in ``items`` of the items it owns (e.g. the scored positions)."""
        owner = torch.empty(self.n, dtype=torch.int64)
        for r, ix in enumerate(self.index):
            owner[ix] = r
        own = owner[items]
        return Partition(n=items.numel(), index=tuple(torch.nonzero(own == r).flatten() for r in range(self.size)))


@dataclass(frozen=True, kw_only=True)
class CPSlice:
    """This rank's share of a packed micro-batch under context parallelism (see module doc)."""

    cp: int
    rank: int
    tokens: Partition  # of the T packed positions
    runs: tuple[QueryRun, ...]  # this rank's query rows, in packed (= local) order

    @property
    def local_index(self) -> torch.Tensor:
        """``[T_r]`` packed positions held by this rank, ascending (the local sequence)."""
        return self.tokens.index[self.rank]


def chunk_bounds(length: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries cutting ``length`` into parts that differ by at most one."""
    base, extra = divmod(length, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def _segments(layout: AttentionLayout) -> list[tuple[int, int, int, int]]:
    """(seg_start, seg_end, prefix_start, prefix_end) of every prompt and response, packed order."""
    out = []
    for g in layout.groups:
        p_end = g.start + g.prompt_len
        out.append((g.start, p_end, g.start, g.start))
        for r_start, r_len in zip(g.response_starts, g.response_lens, strict=True):
            out.append((r_start, r_start + r_len, g.start, p_end))
    return out


def zigzag_runs(layout: AttentionLayout, cp: int, rank: int) -> tuple[QueryRun, ...]:
    """Rank ``rank``'s runs: chunks ``rank`` and ``2cp-1-rank`` of every segment (empty ones dropped)."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"parallel.cp: rank {rank} of a context-parallel size {cp}")
    runs = []
    for s, e, ps, pe in _segments(layout):
        b = chunk_bounds(e - s, 2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            if b[c + 1] > b[c]:
                runs.append(QueryRun(start=s + b[c], end=s + b[c + 1], seg_start=s, prefix_start=ps, prefix_end=pe))
    return tuple(runs)


def build_cp_slice(layout: AttentionLayout, cp: int, rank: int) -> CPSlice:
    """The per-segment zigzag split of ``layout`` over ``cp`` ranks, seen from ``rank``."""
    per_rank = []
    for r in range(cp):
        runs = zigzag_runs(layout, cp, r)
        per_rank.append(torch.cat([torch.arange(x.start, x.end) for x in runs]) if runs else torch.zeros(0).long())
    tokens = Partition(n=layout.total_tokens, index=tuple(per_rank))
    return CPSlice(cp=cp, rank=rank, tokens=tokens, runs=zigzag_runs(layout, cp, rank))


def cp_slice_of(layout: AttentionLayout, cp: int, rank: int) -> CPSlice:
    """``build_cp_slice``, cached on the layout (every layer and copy of a micro-batch reuses it)."""
    return layout.cached_plan(("cp_slice", cp, rank), lambda: build_cp_slice(layout, cp, rank))


@dataclass(frozen=True, kw_only=True)
class CPScoring:
    """The scored positions (``PackedMicroBatch.logit_index``) this rank holds."""

    items: Partition  # of the N scored positions, by the rank holding each one's hidden state
    local_rows: torch.Tensor  # [N_r] rows of the rank's local sequence, for its items in order


def cp_scoring_of(cp_slice: CPSlice, layout: AttentionLayout, logit_index: torch.Tensor) -> CPScoring:
    """Which scored positions this rank computes log-probs for (cached on ``layout``, to which
    ``logit_index`` belongs): their local rows, and the partition that gathers the ``[N]``."""

    def build() -> CPScoring:
        index = logit_index.cpu()
        items = cp_slice.tokens.restrict(index)
        mine = index[items.index[cp_slice.rank]]
        return CPScoring(items=items, local_rows=torch.searchsorted(cp_slice.local_index, mine))

    return layout.cached_plan(("cp_scoring", cp_slice.cp, cp_slice.rank), build)
