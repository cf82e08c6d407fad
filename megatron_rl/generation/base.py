"""The generation contract: what one batch asks of a generator, what it yields, and the registry
that builds generators by name.

- ``BatchRequest``: a batch's step, its prompts (``PromptItem``s, prompt order), the group
  size G and the base sampling seed. Trajectory k of prompt p is ``request_id(step,
  prompt_id, k)``; every seed a generator draws is ``batch.seed(key, k)`` (``request_seed``
  of the base seed, the step, a key naming the prompt, k), so re-runs and every pipeline mode
  sample the same tokens.
- ``Generator.run(engine, batch, stop=, check_version=)`` yields one ``Trajectory`` per (p, k)
  as it finishes, or one ``FailedGroup`` for a prompt given up before generating (all its k);
  ``check_version(request_id, version)`` sees every engine result (the producer's staleness
  schedule); once ``stop`` is set it returns early. It never scores: the producer calls the
  task reward when a trajectory carries no reward of its own.
- ``BatchRequest.carried`` (partial rollout: ``pipeline.carry_over``): trajectories an earlier
  batch began, keyed by their (p, k) in this batch; a generator that sets ``continues_partial``
  yields a finished one as it is and continues an aborted one from its tokens.
- ``Generator.overlong_lengths(samples, max_len)``: what DAPO overlong shaping measures of a
  finished group (each response's length against ``max_len``, or a budget of its own).
- Optionally ``Generator.metrics()``: counters of its own for the trainer's log
  (``generator_metrics``; the agent generator's ``agent/...``).

A generator is registered under a name (``register_generator``) with a factory taking a
``GeneratorSetup``; ``build_generator(name, setup)`` builds it, or the factory at a dotted path
``"pkg.mod:factory"``. The config's ``rollout.generator`` names it (``trainer.from_config``;
``auto``: ``single_turn`` for ``environment.kind: none``, else ``multi_turn``). Nothing here imports the
pipeline: the pipeline depends on generation, not the reverse.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_rl.config.resources import find_dotted
from megatron_rl.config.schema import DataConfig, EnvironmentConfig
from megatron_rl.config.schema_agent import AgentConfig
from megatron_rl.rollout.types import RolloutEngine, RoutedExperts, SamplingSettings


def group_id(step: int, prompt_id: str) -> str:
    """The id of prompt ``prompt_id``'s group at ``step``: ``"<step>/<prompt_id>"``."""
    return f"{step}/{prompt_id}"


def request_id(step: int, prompt_id: str, k: int) -> str:
    """Unique id of sample ``k`` of prompt ``prompt_id`` at ``step``: ``"<step>/<prompt_id>/<k>"``."""
    return f"{group_id(step, prompt_id)}/{k}"


def request_seed(base_seed: int, step: int, prompt_id: str, k: int) -> int:
    """Deterministic 63-bit sampling seed of one request (blake2b of the four values)."""
    digest = hashlib.blake2b(f"{base_seed}|{step}|{prompt_id}|{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class PromptRecordLike(Protocol):
    """What generation needs of a prompt record (``data.PromptRecord`` fits)."""

    @property
    def prompt_id(self) -> str: ...


class PromptItem(Protocol):
    """A record and its prompt token ids (``data.TokenizedPrompt`` fits)."""

    @property
    def record(self) -> PromptRecordLike: ...

    @property
    def token_ids(self) -> tuple[int, ...]: ...


@dataclass(frozen=True, kw_only=True)
class BatchRequest:
    """One batch to generate: G trajectories for each of ``items``."""

    step: int
    items: tuple[PromptItem, ...]  # prompt order: prompt_index p is a position here
    group_size: int  # G
    base_seed: int  # rollout.sampling.seed
    # Partial rollout (pipeline.carry_over): (p, k) -> what an earlier batch generated of it, a
    # finished trajectory (re-yielded as it is) or an aborted one (finish_reason "abort": continued
    # from its tokens). Only a generator with ``continues_partial`` accepts a non-empty one.
    carried: Mapping[tuple[int, int], Trajectory] = field(default_factory=dict)

    def group_id(self, p: int) -> str:
        """Prompt ``p``'s group: ``"<step>/<prompt_id>"``, the prefix of its trajectories' ids."""
        return group_id(self.step, self.items[p].record.prompt_id)

    def request_id(self, p: int, k: int) -> str:
        """Trajectory ``k`` of prompt ``p``: ``"<step>/<prompt_id>/<k>"`` (``request_id``)."""
        return request_id(self.step, self.items[p].record.prompt_id, k)

    def seed(self, key: str, k: int) -> int:
        """The sampling seed of trajectory ``k`` under ``key`` (the prompt id, or a turn of it)."""
        return request_seed(self.base_seed, self.step, key, k)


@dataclass(frozen=True, kw_only=True)
class Trajectory:
    """One finished (prompt, k): the response region is every id after the prompt.

    Single-turn: one model turn, ``loss_mask`` None (every response token is the model's).
    Multi-turn: model turns with observations spliced between them (``loss_mask`` 0)."""

    request_id: str  # "<step>/<prompt_id>/<k>" (multi-turn turns add "/<turn>")
    prompt_index: int
    k: int
    prompt_ids: tuple[int, ...]  # [Lp] shared by the group
    response_ids: tuple[int, ...]  # [Lr] model (and observation) tokens, in order
    loss_mask: tuple[int, ...] | None  # [Lr] 1 = model token, 0 = observation token; None: all model
    behav_logprobs: tuple[float, ...]  # [Lr] the engine's log-prob on model tokens, 0.0 on observations
    turn_versions: tuple[int, ...]  # weight version of each model turn
    finish_reason: str  # of the last model turn ("stop" / "length")
    last_text: str  # the last model turn's text (what the reward function sees)
    truncated: bool = False  # ended by a budget, not by its environment
    reward: float | None = None  # the environment's final reward (None: the task reward function scores)
    tool_calls: int = 0
    tool_errors: int = 0
    env_failures: int = 0
    env_s: float = 0.0
    turn_prompt_tokens: int = 0  # sum over its turns of each turn's prompt length (multi-turn)
    cached_tokens: int | None = None  # of those, served by the engine's prefix cache (None: not reported)
    routed_experts: RoutedExperts | None = None  # MoE routes of the forwarded tokens (single-turn)
    token_versions: tuple[int, ...] | None = None  # [Lr] in-flight updates: each token's version; None: turn_versions

    def __post_init__(self) -> None:
        assert self.token_versions is not None or len(set(self.turn_versions)) == 1, (
            self.request_id,
            self.turn_versions,
        )
        assert self.loss_mask is None or len(self.loss_mask) == len(self.response_ids)
        assert len(self.response_ids) == len(self.behav_logprobs)

    @property
    def turns(self) -> int:
        return len(self.turn_versions)


@dataclass(frozen=True, kw_only=True)
class FailedGroup:
    """A prompt given up before generating (its environment reset failed): no trajectory of it."""

    prompt_index: int
    base: str  # the group's "<step>/<prompt_id>"
    error: str  # the first failure's message


@dataclass(frozen=True)
class OverlongLengths:
    """What DAPO overlong shaping measures of one group: the length limit, each response's length."""

    max_len: int
    lengths: tuple[int, ...]  # [G]


class MeasuredSample(Protocol):
    """What overlong measuring reads of a scored sample (``pipeline.Sample`` fits)."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    truncated: bool


def response_lengths(samples: Sequence[MeasuredSample], max_len: int) -> OverlongLengths:
    """Each response's length against ``max_len`` (algorithm.overlong's single-turn measure)."""
    return OverlongLengths(max_len=max_len, lengths=tuple(len(s.response_ids) for s in samples))


class Generator(Protocol):
    """Turns a batch of prompts into trajectories on an engine (module doc)."""

    def run(
        self,
        engine: RolloutEngine,
        batch: BatchRequest,
        *,
        stop: threading.Event,
        check_version: Callable[[str, int], None],
    ) -> Iterator[Trajectory | FailedGroup]: ...

    def overlong_lengths(self, samples: Sequence[MeasuredSample], max_len: int) -> OverlongLengths: ...


@dataclass(frozen=True, kw_only=True)
class GeneratorSetup:
    """Everything a registered generator is built from (``build_generator``)."""

    sampling: SamplingSettings  # rollout.sampling (stop ids: the tokenizer's EOS and the stop strings)
    tokenizer: Any  # HF tokenizer: decodes responses for the reward, renders chat turns
    environment: EnvironmentConfig = EnvironmentConfig()  # the environment section (multi-turn)
    agent: AgentConfig = AgentConfig()  # the agent section (agent rollouts over the gateway)
    instruction: str | None = DataConfig.instruction  # data.instruction (multi-turn reset fields)


def generator_metrics(generator: Generator) -> dict[str, float]:
    """The generator's own counters for the trainer's log ({} when it has none)."""
    metrics = getattr(generator, "metrics", None)
    return metrics() if callable(metrics) else {}


GeneratorFactory = Callable[[GeneratorSetup], Generator]
_GENERATORS: dict[str, GeneratorFactory] = {}


def register_generator(name: str) -> Callable[[GeneratorFactory], GeneratorFactory]:
    """Decorator: register a factory ``setup -> Generator`` (a class fits) under ``name``."""

    def register(factory: GeneratorFactory) -> GeneratorFactory:
        if name in _GENERATORS and _GENERATORS[name] is not factory:
            raise ValueError(f"generator {name!r} is already registered ({_GENERATORS[name]!r})")
        _GENERATORS[name] = factory
        return factory

    return register


def build_generator(name: str, setup: GeneratorSetup) -> Generator:
    """The generator registered as ``name`` (or made by the factory at the dotted path
    ``"pkg.mod:factory"``), built from ``setup``."""
    import megatron_rl.generation  # noqa: F401 -- registers the built-in generators

    if ":" in name:
        factory, why = find_dotted(name)
        if why:
            raise ValueError(f"rollout.generator: {name!r}: {why}")
        return factory(setup)
    if name not in _GENERATORS:
        raise ValueError(f"rollout.generator: unknown generator {name!r}: registered are {sorted(_GENERATORS)}")
    return _GENERATORS[name](setup)
