"""The records that cross the rollout boundary, and the engine contract.

Flow (one way): the producer turns prompts into ``GenerationRequest``s, an engine answers
each with exactly one ``GenerationResult`` (sampled token ids, their behaviour log-probs and
the weight version that produced them), and the trainer pushes new weights with
``update_weights`` between batches (a HF safetensors snapshot written by
``megatron_rl.models.save_hf_checkpoint``).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from megatron_rl.config.fields import require_values
from megatron_rl.config.schema import SamplingConfig


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

    def update_weights(self, snapshot_dir: str, version: int) -> None:
        """Load the HF safetensors weights in ``snapshot_dir`` into every worker; return once all
        workers run ``version``. (On CPU the trainer writes the snapshot to shared memory or disk;
        on devices a NCCL/HCCL broadcast group replaces the directory.)"""
        ...

    def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast HF-named full tensors to every worker (a gloo / NCCL / HCCL group with
        this process) and load them as ``version``; return once all run it. At PP > 1 the
        trainer passes ``peers=`` (``weight_sync.StagePeers``: the other stages' senders);
        an engine that takes no ``peers`` supports PP = 1 only."""
        ...

    def update_weights_from_shared(self, layouts: Sequence[Any], version: int) -> None:
        """Load the tensors each PP stage's sender wrote to shared memory (``SharedLayout`` per
        stage, ``rollout.shared_weights``) into every worker as ``version``; return once all
        run it. Only for engines on the trainer's machine (``rollout.weight_sync=shared_memory``)."""
        ...

    @property
    def weight_version(self) -> int:
        """The version every worker currently runs."""
        ...

    def shutdown(self) -> None:
        """Stop the workers and free their resources (idempotent)."""
        ...
