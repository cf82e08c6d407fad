"""Agent rollouts: users' agents, written against the OpenAI chat API, run unchanged per
trajectory against the gateway (``megatron_rl.gateway``), and their sessions become trajectories.

Per batch: one ``EngineLink`` (one ``generate_stream``: every turn of the batch runs one weight
version) and one gateway session per (prompt, k), keyed ``"<step>/<prompt_id>/<k>"`` (turn t:
``".../<k>/<t>"``, seeded ``BatchRequest.seed("<prompt_id>/<t>", k)``: reruns and every pipeline
mode sample the same tokens). The agent ``run(task, base_url) -> reward | None`` (``task``:
``environments.record_fields`` of the record) runs on a thread of its own, at most
``workers`` at a time, each given ``timeout_s``. A crash, a timeout or a return that is neither
a number nor None ends that trajectory as a counted failure (``AgentStats``; the trajectory's
``env_failures`` = 1, scored by the task reward), never the run; its session is closed (later
requests get 409).

A group is yielded once its K agents ended. A trajectory is its session's last branch
(``gateway.session``): model tokens mask 1 with the engine's log-probs, everything else mask 0.
The group's prompt is the longest common prefix of its K first prompts; what a trajectory's
first prompt has beyond it goes into its response with mask 0. A group with an agent that
never got a model turn, or whose prompts share no token, is given up (``FailedGroup``).
Reward: the agent's return value, or the task reward function when it returned None.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from megatron_rl.environments.base import record_fields
from megatron_rl.gateway import EngineLink, Gateway, GatewaySettings, Session, TemplateCodec
from megatron_rl.generation.base import (
    BatchRequest,
    FailedGroup,
    GeneratorSetup,
    MeasuredSample,
    OverlongLengths,
    Trajectory,
    register_generator,
)
from megatron_rl.rollout.feed import StreamingEngine
from megatron_rl.rollout.types import compact_token_versions

AgentFn = Callable[[Mapping[str, Any], str], Any]


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """The ``agent`` section as the generator uses it."""

    run: AgentFn
    workers: int
    timeout_s: float
    max_total_tokens: int  # prompt + model + observation tokens of one session
    instruction: str | None = None  # data.instruction (the task's messages)


@dataclass
class AgentStats:
    """Counts over the generator's life, logged every step as ``agent/<field>`` (run totals,
    like the ``data/`` and ``reward/`` counters): trajectories ended, failures by kind, requests
    refused, model turns, branches beyond a session's first, tool calls the model made."""

    trajectories: int = 0
    crashed: int = 0  # the agent raised
    timed_out: int = 0  # ran past agent.timeout_s
    bad_return: int = 0  # returned neither a number nor None
    malformed_requests: int = 0  # requests answered with an error (malformed, over budget, closed)
    turns: int = 0  # model turns of the trajectories (their last branches)
    branches: int = 0  # sessions' branches beyond their first
    tool_calls: int = 0  # tool calls parsed from the trajectories' model turns
    groups_failed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, session: Session, outcome: Outcome) -> None:
        """Count one ended trajectory (``session``: its gateway session)."""
        with self._lock:
            self.trajectories += 1
            self.malformed_requests += session.malformed
            self.branches += max(0, len(session.branches) - 1)
            if session.current is not None:
                self.turns += len(session.current.versions)
                self.tool_calls += session.current.tool_calls
            if outcome.failure:
                setattr(self, outcome.failure, getattr(self, outcome.failure) + 1)

    def group_failed(self) -> None:
        """Count one group given up (``FailedGroup``)."""
        with self._lock:
            self.groups_failed += 1

    def metrics(self) -> dict[str, float]:
        """``agent/<count>`` per field, and ``agent/failures`` (crashed + timed_out + bad_return)."""
        with self._lock:
            out = {f"agent/{k}": float(v) for k, v in vars(self).items() if not k.startswith("_")}
        return out | {"agent/failures": out["agent/crashed"] + out["agent/timed_out"] + out["agent/bad_return"]}


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """How one agent call ended."""

    reward: float | None = None
    failure: str | None = None  # "crashed" / "timed_out" / "bad_return"
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class Job:
    """One agent call: ``call()`` is the agent's return value (or raises)."""

    key: tuple[int, int]  # (prompt index, k)
    call: Callable[[], Any]


@dataclass(kw_only=True)
class _Group:
    p: int
    base: str
    sids: list[str]
    ended: dict[int, tuple[Session, Outcome]] = field(default_factory=dict)


class AgentGenerator:
    """Runs a batch's agents against the gateway (module doc)."""

    def __init__(self, *, settings: AgentSettings, gateway: Gateway) -> None:
        self.settings, self.gateway = settings, gateway
        self.stats = AgentStats()

    def run(
        self,
        engine: StreamingEngine,
        batch: BatchRequest,
        *,
        stop: threading.Event,
        check_version: Callable[[str, int], None],
    ) -> Iterator[Trajectory | FailedGroup]:
        """One trajectory per (prompt, k), by group as each group's agents end (module doc)."""
        link = EngineLink(engine)
        self.gateway.link = link
        groups = self._open(batch)
        jobs = [
            Job(key=(p, k), call=partial(self._call, batch.items[p].record, sid))
            for p, g in groups.items()
            for k, sid in enumerate(g.sids)
        ]
        tick = partial(_check, link, check_version)
        try:
            for (p, k), outcome in run_jobs(jobs, self.settings, stop=stop, tick=tick):
                group = groups[p]
                group.ended[k] = (
                    self.gateway.close_session(group.sids[k], outcome.failure or "its agent ended"),
                    outcome,
                )
                if len(group.ended) == batch.group_size:
                    tick()
                    yield from self._finish(groups.pop(p))
        finally:
            for sid in [s for g in groups.values() for s in g.sids if s in self.gateway.sessions]:
                self.gateway.close_session(sid, "the batch ended")
            self.gateway.link = None
            link.close(abort=stop.is_set())
        if link.error is not None:
            raise RuntimeError("the engine stream of the agents' turns failed") from link.error

    def metrics(self) -> dict[str, float]:
        """The ``agent/...`` counts for the trainer's log (``AgentStats.metrics``)."""
        return self.stats.metrics()

    def overlong_lengths(self, samples: Sequence[MeasuredSample], max_len: int) -> OverlongLengths:
        """The session budget less the prompt (not ``max_len``); a truncated trajectory reaches it."""
        room = self.settings.max_total_tokens - len(samples[0].prompt_ids)
        return OverlongLengths(
            max_len=room, lengths=tuple(room if s.truncated else len(s.response_ids) for s in samples)
        )

    def _open(self, batch: BatchRequest) -> dict[int, _Group]:
        """A gateway session per (prompt, k), keyed and seeded as the module doc says."""
        groups = {}
        for p, item in enumerate(batch.items):
            pid, sids = item.record.prompt_id, []
            for k in range(batch.group_size):
                session = Session(
                    key=batch.request_id(p, k),
                    codec=self.gateway.codec,
                    max_total_tokens=self.settings.max_total_tokens,
                    seed_of=lambda t, k=k, pid=pid: batch.seed(f"{pid}/{t}", k),
                )
                sids.append(self.gateway.open_session(session))
            groups[p] = _Group(p=p, base=batch.group_id(p), sids=sids)
        return groups

    def _call(self, record: Any, sid: str) -> Any:
        task = record_fields(record, instruction=self.settings.instruction)
        return self.settings.run(task, self.gateway.base_url(sid))

    def _finish(self, group: _Group) -> list[Trajectory | FailedGroup]:
        """The group's trajectories (module doc), or a ``FailedGroup``; counts into ``stats``."""
        ended = [group.ended[k] for k in range(len(group.ended))]
        st = self.stats
        for session, outcome in ended:
            st.add(session, outcome)
        branches = [s.current for s, _ in ended]
        firsts = [b.prompt_ids for b in branches if b is not None]
        shared = _common_prefix(firsts) if len(firsts) == len(branches) else 0
        if shared == 0:
            st.group_failed()
            why = next((o.error for _, o in ended if o.failure), "") or "an agent made no model request"
            if len(firsts) == len(branches):
                why = "the group's first prompts share no token"
            return [FailedGroup(prompt_index=group.p, base=group.base, error=why)]
        prompt = firsts[0][:shared]
        return [_trajectory(s, o, prompt=prompt, p=group.p, k=k) for k, (s, o) in enumerate(ended)]


def _trajectory(session: Session, outcome: Outcome, *, prompt: tuple[int, ...], p: int, k: int) -> Trajectory:
    """A session's last branch as a trajectory after the group's shared ``prompt``."""
    b = session.current
    extra = b.prompt_ids[len(prompt) :]
    versions = (b.versions[0],) * len(extra) + tuple(b.token_versions)  # the prompt's rest: the first turn's
    return Trajectory(
        request_id=session.key,
        prompt_index=p,
        k=k,
        prompt_ids=prompt,
        response_ids=extra + tuple(b.ids),
        loss_mask=(0,) * len(extra) + tuple(b.mask),
        behav_logprobs=(0.0,) * len(extra) + tuple(b.logprobs),
        turn_versions=tuple(b.versions),
        token_versions=compact_token_versions(versions),
        finish_reason=b.finish_reason,
        last_text=b.last_text,
        truncated=b.finish_reason == "length",
        reward=outcome.reward,
        tool_calls=b.tool_calls,
        tool_errors=b.tool_errors,
        env_failures=int(outcome.failure is not None),
    )


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def _check(link: EngineLink, check_version: Callable[[str, int], None]) -> None:
    """Show the producer's staleness check every turn answered so far (on the caller's thread)."""
    for rid, version in link.results():
        check_version(rid, version)


def run_jobs(
    jobs: Sequence[Job], settings: AgentSettings, *, stop: threading.Event, tick: Callable[[], None]
) -> Iterator[tuple[tuple[int, int], Outcome]]:
    """Run ``jobs`` on daemon threads, ``settings.workers`` at a time, each for at most
    ``settings.timeout_s`` (a timed-out one is left behind, its slot freed); yield each job's
    ``Outcome`` as it ends. ``tick`` runs between waits; returns early once ``stop`` is set."""
    done: queue.Queue = queue.Queue()
    pending, running = deque(jobs), {}
    while pending or running:
        while pending and len(running) < settings.workers:
            job = pending.popleft()
            running[job.key] = time.monotonic()
            threading.Thread(target=_call_job, args=(job, done), name="megatron_rl-agent", daemon=True).start()
        if stop.is_set():
            return
        tick()
        try:
            key, outcome = done.get(timeout=0.02)
        except queue.Empty:
            now = time.monotonic()
            for key in [key for key, t0 in running.items() if now - t0 > settings.timeout_s]:
                del running[key]
                yield (
                    key,
                    Outcome(failure="timed_out", error=f"the agent ran past agent.timeout_s={settings.timeout_s}"),
                )
            continue
        if running.pop(key, None) is not None:  # else it had timed out already
            yield key, outcome


def _call_job(job: Job, done: queue.Queue) -> None:
    """Thread body: the agent's return value as an ``Outcome``."""
    try:
        value = job.call()
    except BaseException as exc:  # noqa: BLE001 -- a crashed agent ends its trajectory, not the run
        done.put((job.key, Outcome(failure="crashed", error=f"{type(exc).__name__}: {exc}")))
        return
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        done.put((job.key, Outcome(reward=None if value is None else float(value))))
    else:
        done.put((job.key, Outcome(failure="bad_return", error=f"the agent returned {value!r}, not a number or None")))


@register_generator("agent")
def build_agent(setup: GeneratorSetup) -> AgentGenerator:
    """The ``agent`` section's generator: its function, its pool, and a started gateway over the
    tokenizer's chat template (the template's end-of-turn token among every turn's stop ids)."""
    from megatron_rl.config.resources import find_dotted

    a = setup.agent
    fn, why = find_dotted(a.run)
    if why:
        raise ValueError(f"agent.run: {a.run!r}: {why}")
    settings = AgentSettings(
        run=fn,
        workers=a.workers,
        timeout_s=a.timeout_s,
        max_total_tokens=a.max_total_tokens,
        instruction=setup.instruction,
    )
    gateway = Gateway(
        GatewaySettings(host=a.host, port=a.port, key=a.key),
        codec=TemplateCodec(setup.tokenizer),
        sampling=setup.sampling,
    )
    return AgentGenerator(settings=settings, gateway=gateway.start())
