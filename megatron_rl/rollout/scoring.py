"""Prefill-only scoring: an engine's log-probs of given tokens at the version it runs.

``RolloutEngine.score(requests)`` answers each ``ScoreRequest`` (prompt ids + response ids) with
a ``ScoreResult``: ``log_softmax(logits / T)`` of every response token, teacher-forced, no
sampling and no top-p (the trainer's convention, ``vocab_parallel_logprobs``), stamped with the
weight version it ran at. The trainer's engine probe (``trainer.engine_probe``) compares them
with its own log-probs of the same tokens at that version, right after each weight sync.

Backends (inside a worker process; ``hf_score`` in ``backends.hf``, ``vllm_score`` in ``backends.vllm``):

- ``hf``: one forward per request over ``prompt + response`` (no cache), any temperature > 0.
- ``vllm``: ``prompt_logprobs=0`` on ``prompt + response`` with ``max_tokens=1`` (the one
  sampled token is thrown away). vLLM 0.32 computes prompt log-probs from the raw logits,
  before every sampling processor, temperature included (``gpu_model_runner.
  _get_prompt_logprobs_dict``: "prompt tokens skip sampling processors"), so it scores at
  temperature 1 only and refuses any other. Requests with prompt log-probs skip the prefix
  cache (``SamplingParams.skip_reading_prefix_cache``), so every token is recomputed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ScoreRequest:
    """Tokens to score: ``request_id`` unique within one ``score`` call."""

    request_id: str
    prompt_ids: tuple[int, ...]  # [Lp], Lp >= 1
    response_ids: tuple[int, ...]  # [Lr], Lr >= 1: the tokens whose log-probs come back
    temperature: float = 1.0  # > 0: log_softmax(logits / temperature)

    def __post_init__(self) -> None:
        if not self.prompt_ids or not self.response_ids:
            raise ValueError(f"score request {self.request_id!r}: prompt and response must be non-empty")
        if not self.temperature > 0:
            raise ValueError(f"score request {self.request_id!r}: temperature must be > 0, got {self.temperature}")


@dataclass(frozen=True, kw_only=True)
class ScoreResult:
    """The answer to one ``ScoreRequest``."""

    request_id: str
    logprobs: tuple[float, ...]  # [Lr] log_softmax(logits / T) of each response token
    weight_version: int  # version of the weights that scored it


def in_request_order(results: Iterable[ScoreResult], requests: Sequence[ScoreRequest]) -> tuple[ScoreResult, ...]:
    """``results`` (any order, one per request) in the order of ``requests``."""
    by_id = {r.request_id: r for r in results}
    missing = [r.request_id for r in requests if r.request_id not in by_id]
    if missing:
        raise RuntimeError(f"score: no answer for requests {missing[:5]}")
    return tuple(by_id[r.request_id] for r in requests)


def check_unique(requests: Sequence[ScoreRequest]) -> None:
    """``ValueError`` if two requests share an id."""
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"score requests: request_id {next(i for i in ids if ids.count(i) > 1)!r} appears twice")
