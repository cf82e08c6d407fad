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

import numpy as np

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


@dataclass(frozen=True, eq=False)
class RoutedExperts:
    """The experts an MoE engine routed each token to: ``indices [tokens, layers, top_k]``.

    vLLM's ``routed_experts`` layout: rows are the tokens the engine *forwarded* (the prompt and
    every response token but the last, which was sampled and never fed back: ``Lp + Lr - 1``
    rows); one column per decoder layer (a dense layer's column means nothing and is never
    read). int16: up to 32767 experts.
    """

    indices: np.ndarray  # [tokens, layers, top_k] int16

    def __post_init__(self) -> None:
        if self.indices.ndim != 3:
            raise ValueError(f"routed experts must be [tokens, layers, top_k], got shape {self.indices.shape}")
        object.__setattr__(self, "indices", np.ascontiguousarray(self.indices, dtype=np.int16))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RoutedExperts) and np.array_equal(self.indices, other.indices)

    __hash__ = None  # type: ignore[assignment]  # an array: compared by value, never hashed

    @property
    def num_tokens(self) -> int:
        return int(self.indices.shape[0])


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
    finish_reason: Literal["stop", "length", "abort"]  # abort: ended by an Abort (rollout.worker), tokens so far
    weight_version: int  # version of the weights every token was sampled with (in-flight: the first token's)
    routed_experts: RoutedExperts | None = None  # MoE routes of the forwarded tokens, when asked for
    cached_tokens: int | None = None  # prompt tokens the engine's prefix cache served (None: not reported)
    # In-flight weight updates (rollout.in_flight_updates): the version that sampled each response
    # token, non-decreasing from weight_version; None: every token at weight_version
    token_versions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_token_versions(self.request_id, self.token_versions, len(self.response_ids), self.weight_version)

    @property
    def versions_per_token(self) -> tuple[int, ...]:
        """The version that sampled each response token (``weight_version`` throughout when
        ``token_versions`` is None)."""
        if self.token_versions is not None:
            return self.token_versions
        return (self.weight_version,) * len(self.response_ids)


def compact_token_versions(versions: Sequence[int]) -> tuple[int, ...] | None:
    """Per-token versions as a record's ``token_versions`` holds them: None when one version
    sampled every token (or there is none), else the tuple."""
    return tuple(versions) if len(set(versions)) > 1 else None


def check_token_versions(request_id: str, versions: tuple[int, ...] | None, length: int, first: int) -> None:
    """Raise unless ``versions`` is None or one non-decreasing version per response token
    starting at ``first``."""
    if versions is None:
        return
    if (
        len(versions) != length
        or versions[0] != first
        or any(b < a for a, b in zip(versions, versions[1:], strict=False))
    ):
        raise ValueError(
            f"request {request_id!r}: token_versions must hold one non-decreasing version per response "
            f"token ({length}) starting at weight_version {first}; got {versions[:8]}..."
        )


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
