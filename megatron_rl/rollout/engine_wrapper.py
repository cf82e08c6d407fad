"""``EngineWrapper``: the base of engines that wrap another one (``train(engine_factory=...)``).

A wrapper changes what it needs, usually ``generate`` (record results, inject faults, reorder,
route to a remote service) and forwards everything else of the ``RolloutEngine`` contract to
``inner`` unchanged, so the weight-version bookkeeping stays the wrapped engine's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from megatron_rl.rollout.scoring import ScoreRequest, ScoreResult
from megatron_rl.rollout.types import GenerationRequest, GenerationResult, RolloutEngine
from megatron_rl.weight_sync import WeightUpdate


class EngineWrapper:
    """A ``RolloutEngine`` forwarding every call to ``inner``; subclasses override what they change."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner = inner

    def generate(self, requests: Sequence[GenerationRequest]) -> Iterator[GenerationResult]:
        return self.inner.generate(requests)

    def generate_stream(self, feed):
        """Forwarded as is: a wrapper that changes ``generate`` must override this too to see turns."""
        return self.inner.generate_stream(feed)

    def score(self, requests: Sequence[ScoreRequest]) -> tuple[ScoreResult, ...]:
        return self.inner.score(requests)

    def load_weights(self, update: WeightUpdate, version: int) -> None:
        self.inner.load_weights(update, version)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def shutdown(self) -> None:
        self.inner.shutdown()

    def __getattr__(self, name: str):  # status(), ... of the wrapped pool
        return getattr(self.inner, name)


class StreamRecorder(EngineWrapper):
    """Keeps every turn result ``generate_stream`` yields, by request id (``results``)."""

    def __init__(self, inner: RolloutEngine) -> None:
        super().__init__(inner)
        self.results: dict[str, GenerationResult] = {}

    def generate_stream(self, feed):
        """The inner stream, each result kept."""
        for result in self.inner.generate_stream(feed):
            self.results[result.request_id] = result
            yield result
