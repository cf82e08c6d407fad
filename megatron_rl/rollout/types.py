"""The records that cross the rollout boundary, and the engine contract.

Flow (one way): the producer turns prompts into ``GenerationRequest``s, an engine answers
each with exactly one ``GenerationResult`` (sampled token ids, their behaviour log-probs and
the weight version that produced them), and the trainer's weight sender pushes new weights
with ``load_weights`` between batches (a ``megatron_rl.weight_sync.WeightUpdate``).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from megatron_rl.config.fields import require_values
from megatron_rl.config.schema import SamplingConfig

if TYPE_CHECKING:
    from megatron_rl.rollout.scoring import ScoreRequest, ScoreResult
    from megatron_rl.weight_sync import WeightUpdate


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """How to sample one response (mirrors ``rollout.sampling`` in the config)."""

    temperature: float = SamplingConfig.temperature  # 0 = greedy; log-probs then reported at temperature 1
    top_p: float = SamplingConfig.top_p
    max_new_tokens: int = SamplingConfig.max_new_tokens
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one of these (EOS included)
    seed: int | None = None  # per-request seed: the same request gives the same sample

    def __post_init__(self) -> None:
        # A request may be greedy (0); the config's rollout.sampling.temperature is > 0 (log-probs need it).
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature} must be >= 0 (0 means greedy)")
        require_values({"rollout.sampling.top_p": self.top_p, "rollout.sampling.max_new_tokens": self.max_new_tokens})


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One sample to draw: ``request_id`` is unique within a run (e.g. "<step>/<prompt>/<k>")."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingSettings


@dataclass(frozen=True, kw_only=True)
class GenerationResult:
    """The answer to one request."""

    request_id: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # log pi_behav(token) at the sampling temperature, one per response token
    finish_reason: Literal["stop", "length"]
    weight_version: int  # version of the weights every token was sampled with


@runtime_checkable
class RolloutEngine(Protocol):
    """A pool of generation workers. Implementations: ``hf`` (transformers) and ``vllm``."""

    def generate(self, requests: Sequence[GenerationRequest]) -> Iterator[GenerationResult]:
        """Yield one result per request, in completion order (not request order)."""
        ...

    def score(self, requests: Sequence[ScoreRequest]) -> tuple[ScoreResult, ...]:
        """Prefill only: each request's response log-probs at its temperature, teacher-forced, in
        request order, each stamped with the version that scored it (``rollout.scoring``)."""
        ...

    def load_weights(self, update: WeightUpdate, version: int) -> None:
        """Load ``update`` (a snapshot directory, shared-memory layouts, a broadcast: one class per
        ``rollout.weight_sync`` transport, ``megatron_rl.weight_sync``) into every worker; return
        once all workers run ``version``."""
        ...

    @property
    def weight_version(self) -> int:
        """The version every worker currently runs."""
        ...

    def shutdown(self) -> None:
        """Stop the workers and free their resources (idempotent)."""
        ...
