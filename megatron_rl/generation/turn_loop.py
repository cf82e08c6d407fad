"""The turn loop of multi-turn generation: a batch's live trajectories on one ``generate_stream``.

Per trajectory, until the environment says done:
1. a turn request (prompt = prompt + everything so far, as ids) goes on the engine's
   ``RequestFeed``; it stops at the sampling's stop ids (EOS / end of turn);
2. its result's ids are appended as they are (mask 1, the engine's behaviour log-probs);
3. the turn's text (``decode``: only for the environment) goes to ``env.step`` on the
   runner's threads (never the producer's), with its timeout and failure count;
4. the observation messages are appended as the exact ids the chat template adds after an
   assistant turn (``encode_observation``, the next assistant header included; mask 0,
   log-prob 0.0), and the next turn is put on the feed at once.
Model text is never re-encoded: the trained ids are the engine's and the template's.

Turns of all trajectories share the stream: a trajectory's next turn is dispatched while the
others decode (no round barrier; no trajectory waits for another's tool call). Budgets: at
most ``max_turns`` model turns, at most ``max_total_tokens`` prompt + model + observation
tokens (a turn's ``max_new_tokens`` is cut to what is left; an observation that would not fit
is not appended). A trajectory ended by a budget rather than by its environment is
``truncated``; it always ends with a model token. An environment step that raised or timed
out ends its trajectory (``env_failures``), the run goes on.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from megatron_rl.generation.base import Trajectory
from megatron_rl.rollout.feed import RequestFeed, StreamingEngine
from megatron_rl.rollout.types import GenerationRequest, GenerationResult, SamplingSettings, compact_token_versions

EncodeMessages = Callable[[Sequence[Mapping[str, Any]], Sequence[dict]], Sequence[int]]  # (messages, tools) -> ids


class StepRunner(Protocol):
    """Runs environment calls off the caller's thread (``environments.runner.EnvironmentRunner``
    fits): a step's future holds a ``StepResult`` whose ``error`` is set when the call raised or
    hung; a failed reset's future raises ``EnvironmentCallFailed`` (its group is dropped); any
    other exception of a future stops the run (too many failures)."""

    def submit_reset(self, env: Any, record: Mapping[str, Any], *, tag: str = "") -> Future: ...

    def submit_step(self, env: Any, model_turn: str, *, tag: str = "") -> Future: ...


@dataclass(frozen=True, kw_only=True)
class MultiTurnSettings:
    """The ``environment`` section's budgets, and how messages become ids."""

    max_turns: int
    max_total_tokens: int
    encode_prompt: EncodeMessages  # first messages -> prompt ids (template, tools, generation header)
    encode_observation: EncodeMessages  # observation messages -> the ids appended after a model turn
    decode: Callable[[Sequence[int]], str]  # a model turn's ids -> its text (for the environment only)
    instruction: str | None = None  # data.instruction, appended to the record's last user turn (reset fields)


@dataclass(kw_only=True)
class LiveTrajectory:
    """A trajectory in progress (mutated on the producer thread only)."""

    key: str
    p: int
    k: int
    env: Any
    prompt_ids: tuple[int, ...]
    seed_of: Callable[[int], int]  # turn -> sampling seed
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # the version that sampled each response token; an observation carries its turn's last
    token_versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    truncated: bool = False
    reward: float | None = None
    last_text: str = ""
    tool_calls: int = 0
    tool_errors: int = 0
    env_failures: int = 0
    env_s: float = 0.0
    turn_prompt_tokens: int = 0
    cached_tokens: int | None = None

    def finish(self) -> Trajectory:
        return Trajectory(
            request_id=self.key,
            prompt_index=self.p,
            k=self.k,
            prompt_ids=self.prompt_ids,
            response_ids=tuple(self.ids),
            loss_mask=tuple(self.mask),
            behav_logprobs=tuple(self.logprobs),
            turn_versions=tuple(self.versions),
            # None while one version sampled everything (the records' default)
            token_versions=compact_token_versions(self.token_versions),
            finish_reason=self.finish_reason,
            truncated=self.truncated,
            reward=self.reward,
            last_text=self.last_text,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            env_failures=self.env_failures,
            env_s=self.env_s,
            turn_prompt_tokens=self.turn_prompt_tokens,
            cached_tokens=self.cached_tokens,
        )


@dataclass(frozen=True)
class _StepDone:
    key: str
    future: Future
    elapsed_s: float


@dataclass(frozen=True)
class _StreamEnded:
    error: BaseException | None


class TurnLoop:
    """Runs live trajectories' turns to their ends (module doc)."""

    def __init__(
        self, *, settings: MultiTurnSettings, runner: StepRunner, sampling: SamplingSettings, poll_s: float
    ) -> None:
        self.settings, self._runner, self._sampling, self._poll_s = settings, runner, sampling, poll_s

    def run(
        self,
        engine: StreamingEngine,
        live: dict[str, LiveTrajectory],
        *,
        stop: threading.Event,
        check_version: Callable[[str, int], None],
    ) -> Iterator[Trajectory]:
        """Yield each of ``live`` (key -> trajectory, emptied as they finish) when it ends;
        ``check_version(request_id, version)`` sees every turn. Returns early once ``stop`` is set."""
        feed, events = RequestFeed(), queue.Queue()
        for traj in live.values():
            self._submit_turn(feed, traj)
        thread = threading.Thread(target=_pump, args=(engine, feed, events), name="megatron_rl-turns", daemon=True)
        thread.start()
        try:
            yield from self._loop(live, feed, events, stop, check_version)
        finally:
            feed.abort() if live else feed.close()
            thread.join()

    def _loop(
        self,
        live: dict[str, LiveTrajectory],
        feed: RequestFeed,
        events: queue.Queue,
        stop: threading.Event,
        check_version: Callable[[str, int], None],
    ) -> Iterator[Trajectory]:
        while live:
            if stop.is_set():
                return
            try:
                event = events.get(timeout=self._poll_s)
            except queue.Empty:
                continue
            if isinstance(event, _StreamEnded):
                raise RuntimeError(f"the turn stream ended with {len(live)} trajectories unfinished") from event.error
            if isinstance(event, GenerationResult):
                check_version(event.request_id, event.weight_version)
                key, _, _ = event.request_id.rpartition("/")
                traj = live[key]
                if self._on_turn(traj, event, events):
                    yield live.pop(key).finish()
            else:
                traj = live[event.key]
                if self._on_step(traj, event, feed):
                    yield live.pop(event.key).finish()

    def _budget_left(self, traj: LiveTrajectory) -> int:
        return self.settings.max_total_tokens - len(traj.prompt_ids) - len(traj.ids)

    def _submit_turn(self, feed: RequestFeed, traj: LiveTrajectory) -> None:
        turn = len(traj.versions)
        sampling = replace(
            self._sampling,
            seed=traj.seed_of(turn),
            max_new_tokens=min(self._sampling.max_new_tokens, self._budget_left(traj)),
        )
        feed.put(
            GenerationRequest(
                request_id=f"{traj.key}/{turn}", prompt_ids=traj.prompt_ids + tuple(traj.ids), sampling=sampling
            )
        )

    def _on_turn(self, traj: LiveTrajectory, result: GenerationResult, events: queue.Queue) -> bool:
        """Append a model turn; hand its text to the environment. True if the trajectory ended."""
        traj.ids += result.response_ids
        traj.mask += [1] * len(result.response_ids)
        traj.logprobs += result.logprobs
        traj.versions.append(result.weight_version)
        traj.token_versions += result.versions_per_token
        traj.finish_reason = result.finish_reason
        traj.turn_prompt_tokens += len(result.prompt_ids)
        if result.cached_tokens is not None:
            traj.cached_tokens = (traj.cached_tokens or 0) + result.cached_tokens
        traj.last_text = self.settings.decode(result.response_ids)
        # Cut by the budget or by max_new_tokens: no end-of-turn token, so no observation can follow.
        if self._budget_left(traj) <= 0 or result.finish_reason == "length":
            traj.truncated = True
            return True
        start = time.perf_counter()
        future = self._runner.submit_step(traj.env, traj.last_text, tag=result.request_id)
        future.add_done_callback(lambda f: events.put(_StepDone(traj.key, f, time.perf_counter() - start)))
        return False

    def _on_step(self, traj: LiveTrajectory, event: _StepDone, feed: RequestFeed) -> bool:
        """Take the environment's answer: count, append the observation, submit the next turn."""
        traj.env_s += event.elapsed_s
        step = event.future.result()  # raises only past environment.max_failures: the run stops
        traj.tool_calls += step.tool_calls
        traj.tool_errors += step.tool_errors
        if step.error is not None:
            traj.env_failures += 1
            return True
        if step.done:
            traj.reward = step.reward
            return True
        if len(traj.versions) >= self.settings.max_turns:
            traj.truncated = True
            return True
        obs = tuple(self.settings.encode_observation(step.observation, traj.env.tools))
        if len(obs) >= self._budget_left(traj):  # no room for the observation and one more model token
            traj.truncated = True
            return True
        traj.ids += obs
        traj.mask += [0] * len(obs)
        traj.logprobs += [0.0] * len(obs)
        traj.token_versions += [traj.token_versions[-1]] * len(obs)
        self._submit_turn(feed, traj)
        return False


def _pump(engine: StreamingEngine, feed: RequestFeed, events: queue.Queue) -> None:
    """Thread body: move the stream's results onto ``events``; report its end (or error) once."""
    error: BaseException | None = None
    try:
        for result in engine.generate_stream(feed):
            events.put(result)
    except BaseException as exc:  # noqa: BLE001 -- handed to the producer thread, which raises it
        error = exc
    events.put(_StreamEnded(error))
