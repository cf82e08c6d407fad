"""Multi-turn generation, token in / token out: model turns from the engine, observations from an
environment, spliced into one trajectory per (prompt, k) (the turns: ``turn_loop``).

Per trajectory: ``env.reset(record)`` gives the first messages, rendered once with the tools
(``encode_prompt``): the group's shared prompt. Trajectory ids are ``"<step>/<prompt_id>/<k>"``,
turn t of one is ``".../<k>/<t>"``, seeded ``BatchRequest.seed("<prompt_id>/<t>", k)``; reset
gets ``environments.record_fields(record)`` (``data.instruction`` appended).

Turns of all trajectories of a batch share one ``generate_stream`` call. The stream holds the
engine, so no weight load happens inside it: every turn of a batch runs one weight version,
which ``check_version`` (the producer's staleness schedule) checks per turn. Each response
token records the version that sampled it (``turn_loop``; an observation carries its turn's
last; ``Trajectory.token_versions`` stays None while one version sampled everything), so the
loss would read each token's own should turns or tokens ever run different versions.

A reset that failed for any of a group's trajectories (the runner's ``EnvironmentCallFailed``)
drops that group: ``run`` yields a ``FailedGroup`` for it (after every reset of the group
returned, so the failures are counted) and rolls out the others; past
``environment.max_failures`` the runner's futures raise and the run stops.

Rewards: the environment's final reward when it gives one (``Trajectory.reward``), else the
producer scores the last model turn's text. DAPO overlong shaping measures a trajectory's whole
response (model + observation tokens) against what ``environment.max_total_tokens`` leaves
after the prompt; a truncated trajectory (token budget, max_turns, or a turn cut by
max_new_tokens: it never finished) counts as reaching that budget, so it gets the full penalty.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from megatron_rl.environments.base import record_fields
from megatron_rl.environments.runner import EnvironmentCallFailed
from megatron_rl.generation.base import (
    BatchRequest,
    FailedGroup,
    GeneratorSetup,
    MeasuredSample,
    OverlongLengths,
    Trajectory,
    register_generator,
)
from megatron_rl.generation.turn_loop import LiveTrajectory, MultiTurnSettings, StepRunner, TurnLoop
from megatron_rl.rollout.feed import StreamingEngine
from megatron_rl.rollout.types import SamplingSettings


@dataclass(frozen=True, kw_only=True)
class GroupStart:
    """One prompt of a batch: its trajectories' id base, what ``reset`` gets, their seeds."""

    base: str  # "<step>/<prompt_id>": trajectory k is "<base>/<k>", its turn t "<base>/<k>/<t>"
    fields: Mapping[str, Any]  # environments.record_fields(record)
    seed: Callable[[int, int], int]  # (k, turn) -> the turn's sampling seed


class MultiTurnGenerator:
    """Runs a batch's trajectories through a streaming engine and a step runner (module doc)."""

    def __init__(
        self,
        *,
        settings: MultiTurnSettings,
        env_factory: Callable[[], Any],
        runner: StepRunner,
        sampling: SamplingSettings,
        poll_s: float = 0.05,
    ) -> None:
        self.settings, self._env_factory, self._runner = settings, env_factory, runner
        self._turns = TurnLoop(settings=settings, runner=runner, sampling=sampling, poll_s=poll_s)

    def run(
        self,
        engine: StreamingEngine,
        batch: BatchRequest,
        *,
        stop: threading.Event,
        check_version: Callable[[str, int], None],
    ) -> Iterator[Trajectory | FailedGroup]:
        """``run_groups`` over the batch's prompts (ids, reset fields and seeds: module doc)."""
        yield from self.run_groups(
            engine, self._starts(batch), batch.group_size, stop=stop, check_version=check_version
        )

    def run_groups(
        self,
        engine: StreamingEngine,
        starts: Sequence[GroupStart],
        group_size: int,
        *,
        stop: threading.Event,
        check_version: Callable[[str, int], None],
    ) -> Iterator[Trajectory | FailedGroup]:
        """Yield a ``FailedGroup`` for each prompt whose reset failed, then every (prompt, k)
        trajectory of the other ``starts`` x ``group_size`` as it finishes;
        ``check_version(request_id, version)`` sees every turn. Returns early (nothing more
        yielded) once ``stop`` is set."""
        if not isinstance(engine, StreamingEngine):
            raise TypeError(f"multi-turn rollouts need an engine with generate_stream; got {type(engine).__name__}")
        live, failed = self._start(starts, group_size)
        yield from failed
        if live:
            yield from self._turns.run(engine, live, stop=stop, check_version=check_version)

    def overlong_lengths(self, samples: Sequence[MeasuredSample], max_len: int) -> OverlongLengths:
        """The budget the whole response shares (``max_total_tokens`` - prompt, not ``max_len``);
        a truncated trajectory counts as reaching it (module doc)."""
        room = self.settings.max_total_tokens - len(samples[0].prompt_ids)
        return OverlongLengths(
            max_len=room, lengths=tuple(room if s.truncated else len(s.response_ids) for s in samples)
        )

    def _starts(self, batch: BatchRequest) -> list[GroupStart]:
        """Per prompt: trajectory ids "<step>/<prompt_id>/<k>", reset fields, per-turn seeds."""
        return [
            GroupStart(
                base=batch.group_id(p),
                fields=record_fields(it.record, instruction=self.settings.instruction),
                seed=lambda k, turn, pid=it.record.prompt_id: batch.seed(f"{pid}/{turn}", k),
            )
            for p, it in enumerate(batch.items)
        ]

    def _start(self, starts, group_size: int) -> tuple[dict[str, LiveTrajectory], list[FailedGroup]]:
        """Reset one environment per (prompt, k) on the runner: the live trajectories of the
        groups whose K resets succeeded (their first prompts must agree), a ``FailedGroup`` for each other."""
        envs = [[self._env_factory() for _ in range(group_size)] for _ in starts]
        resets = [
            [self._runner.submit_reset(env, dict(start.fields), tag=f"{start.base}/{k}") for k, env in enumerate(row)]
            for start, row in zip(starts, envs, strict=True)
        ]
        live: dict[str, LiveTrajectory] = {}
        failed: list[FailedGroup] = []
        for p, start in enumerate(starts):
            errors = [future.exception() for future in resets[p]]  # waits for every reset of the group
            stopping = next((e for e in errors if e is not None and not isinstance(e, EnvironmentCallFailed)), None)
            if stopping is not None:
                raise stopping  # past environment.max_failures (or a broken runner): the run stops
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                failed.append(FailedGroup(prompt_index=p, base=start.base, error=str(first)))
                continue
            prompt = self._shared_prompt(start.base, [f.result() for f in resets[p]], envs[p])
            for k, env in enumerate(envs[p]):
                key = f"{start.base}/{k}"
                live[key] = LiveTrajectory(
                    key=key,
                    p=p,
                    k=k,
                    env=env,
                    prompt_ids=prompt,
                    seed_of=lambda turn, k=k, seed=start.seed: seed(k, turn),
                )
        return live, failed

    def _shared_prompt(self, base: str, first_messages: Sequence[Any], envs: Sequence[Any]) -> tuple[int, ...]:
        """The group's first prompt ids; ValueError when the K resets disagree or leave no room."""
        shared: tuple[int, ...] | None = None
        for k, (messages, env) in enumerate(zip(first_messages, envs, strict=True)):
            ids = tuple(self.settings.encode_prompt(messages, env.tools))
            if shared is not None and ids != shared:
                raise ValueError(
                    f"environment reset gave trajectory {k} of {base!r} another first prompt "
                    "than trajectory 0: reset must depend on the record only (shared prompt)"
                )
            if len(ids) >= self.settings.max_total_tokens:
                raise ValueError(
                    f"{base}: the first prompt has {len(ids)} tokens, no room for a model turn "
                    f"under environment.max_total_tokens={self.settings.max_total_tokens}"
                )
            shared = ids
        assert shared is not None
        return shared


@register_generator("multi_turn")
def build_multi_turn(setup: GeneratorSetup) -> MultiTurnGenerator:
    """The ``environment`` section's generator: a fresh environment per trajectory, their steps on
    a runner (timeouts, failure count), the tokenizer's chat template for prompts and
    observations, and the sampling with the template's end-of-turn token among the stop ids."""
    from megatron_rl.environments import load_environment
    from megatron_rl.environments.runner import EnvironmentRunner
    from megatron_rl.environments.template import end_of_turn_id, observation_ids, prompt_ids

    e, tokenizer = setup.environment, setup.tokenizer
    factory = load_environment(e.kind, **e.options)
    stop = (*setup.sampling.stop_token_ids, end_of_turn_id(tokenizer, factory().tools))
    settings = MultiTurnSettings(
        max_turns=e.max_turns,
        max_total_tokens=e.max_total_tokens,
        encode_prompt=partial(prompt_ids, tokenizer),
        encode_observation=partial(observation_ids, tokenizer),
        decode=partial(tokenizer.decode, skip_special_tokens=True),
        instruction=setup.instruction,
    )
    return MultiTurnGenerator(
        settings=settings,
        env_factory=factory,
        runner=EnvironmentRunner(timeout_s=e.step_timeout_s, max_failures=e.max_failures),
        sampling=replace(setup.sampling, stop_token_ids=tuple(dict.fromkeys(stop))),
    )
