"""The ``hf`` engine's side of in-flight weight updates (``rollout.in_flight``): the version that
sampled each token of one decode, and which rows an update restarts.

The worker loads an update between two decode steps (``HFBackend.between_steps``); the token
sampled in that step came from the old weights, every later one from the new. The live rows are
then prefilled again, prompt and tokens so far, with the new weights (the KV cache is recomputed,
``rollout.in_flight`` says why), and a row whose first token is older than the update's version
minus ``max_staleness`` starts again from its prompt (abort and re-queue).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_rl.rollout.in_flight import too_stale


class HFInFlight:
    """Per-row token versions of the decode in progress, and the rows an update restarts."""

    def __init__(self) -> None:
        self.version = 0  # the weights the model holds now
        self.versions: list[list[int]] = []  # per request of the decode: each token's version
        self._live: list[int] = []  # rows sampling in the current step
        self._sampled_by = 0  # the version that sampled the current step
        self._restart: set[int] = set()

    def start(self, version: int, num_requests: int) -> None:
        """A new decode of ``num_requests`` rows at ``version``."""
        self.version, self.versions, self._restart = version, [[] for _ in range(num_requests)], set()

    def now(self, rows: Sequence[int]) -> int:
        """The version sampling this step's tokens of ``rows`` (before any update of the step)."""
        self._live, self._sampled_by = list(rows), self.version
        return self.version

    def update(self, version: int, max_staleness: int | None) -> int:
        """An update to ``version`` was loaded; mark the rows it restarts and return their number."""
        self.version = version
        if max_staleness is None:
            return 0
        first = {i: self.versions[i][0] if self.versions[i] else self._sampled_by for i in self._live}
        marked = {i for i, v in first.items() if too_stale(v, version, max_staleness)}
        self._restart |= marked
        return len(marked)

    def restart(self, rows: Sequence[int]) -> list[int]:
        """Of ``rows`` (still decoding), those an update restarts: their versions are dropped."""
        out = [i for i in rows if i in self._restart]
        for i in out:
            self.versions[i].clear()
        self._restart.clear()
        return out

    def token_versions(self, row: int, version: int, max_staleness: int | None) -> tuple[int, tuple[int, ...] | None]:
        """(first token's version, per-token versions or None when all are that one) of ``row``;
        (``version``, None) with in-flight updates off."""
        v = self.versions[row]
        if max_staleness is None or not v:
            return version, None
        return v[0], tuple(v) if v[-1] != v[0] else None
