"""Rank 0's dispatcher alone, at fleet scale: fake engines, fake replicas, realistic lengths.

    python -m megatron_rl bench dispatcher [--replicas 64] [--engines 16] [--prompts 128] [--group-size 16]
                                           [--steps 2] [--reward-ms 0] [--reward-workers 0]

What global rank 0 does per step, for real (``Pipeline`` + producer thread + ``StepBatch``
routing and cutting + ``make_micro_batch`` packing + the dispatcher thread + pickling every
remote replica's micro-batch as ``DispatchChannel.send`` does), with everything else faked
at zero cost: ``--engines`` engines whose answers are made at the step's start, time taken off the figures (prompt
``--prompt-len`` tokens, responses log-normal around ``--median-response`` tokens, cut at
``--max-response``: long-CoT shaped), interleaved round-robin as a fleet answers; replicas
that train in no time (rank 0's own included), so the dispatcher is the only bottleneck.
``--reward-ms`` makes each reward call cost that much CPU (``--reward-workers`` > 0: scored
by a ``rewards.RewardPool``). Prints one JSON line:

    groups_per_s, mb_per_s (MB shipped to other replicas per second), rank0_cpu_s_per_step
    (process CPU seconds, every thread), step_s, tokens_per_step, rank0_cpu_s_per_1m_tokens,
    shipped_mb_per_1m_tokens / with_samples_mb_per_1m_tokens (a micro-batch shipped without /
    with its Sample records: before and after ``replica.shipped``), pack_s_per_1m_tokens,
    pickle_s_per_1m_tokens (and with_samples_pickle_s_per_1m_tokens): CPU seconds of the threads
    doing it, so a loaded machine inflates step_s but hardly these.
"""

from __future__ import annotations

import argparse
import itertools
import pickle
import random
import threading
import time
from dataclasses import dataclass

from megatron_rl.control import FixedController
from megatron_rl.generation import SingleTurnGenerator
from megatron_rl.pipeline import GroupScoring, Pipeline, PipelineSettings, RolloutInputs, StepSpan
from megatron_rl.pipeline import records as records_mod
from megatron_rl.rollout.types import GenerationResult, SamplingSettings
from megatron_rl.trainer.loop import run_step
from megatron_rl.trainer.replica import shipped


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: fleet size, workload shape, steps, reward cost."""
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--engines", type=int, default=16)
    p.add_argument("--prompts", type=int, default=128, help="prompts per step")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--median-response", type=int, default=1024)
    p.add_argument("--max-response", type=int, default=8192)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--reward-ms", type=float, default=0.0, help="CPU cost of one reward call")
    p.add_argument("--reward-workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


def busy_reward(record, text: str) -> float:
    """A reward costing ``record.cost_s`` of CPU; deterministic in the text."""
    end = time.process_time() + getattr(record, "cost_s", 0.0)
    while time.process_time() < end:
        pass
    return float(len(text) % 2)


@dataclass(frozen=True)
class _Record:
    prompt_id: str
    cost_s: float = 0.0


@dataclass(frozen=True)
class _Item:
    record: _Record
    token_ids: tuple[int, ...]


class _Prompts:
    def __init__(self, n: int, length: int, cost_s: float) -> None:
        self.n, self.length, self.cost_s, self.step = n, length, cost_s, 0

    def next_batch(self) -> list[_Item]:
        self.step += 1
        return [
            _Item(_Record(f"s{self.step}p{i}", self.cost_s), tuple(range(3, 3 + self.length))) for i in range(self.n)
        ]


class FakeFleet:
    """``--engines`` engines answering round-robin from answers made beforehand (see the module doc)."""

    def __init__(self, args: argparse.Namespace) -> None:
        rng = random.Random(args.seed)
        self.engines, self.version, self.args = args.engines, 0, args
        self.ids = tuple(rng.randrange(3, 30000) for _ in range(args.max_response))
        self.lps = tuple(-rng.random() for _ in range(args.max_response))
        self.rng = rng
        self.prepare_cpu_s = self.prepare_wall_s = 0.0  # making the answers: not the dispatcher's cost

    @property
    def weight_version(self) -> int:
        return self.version

    def load_weights(self, update, version: int) -> None:
        self.version = version

    def shutdown(self) -> None:
        pass

    def prepare(self, requests) -> list[GenerationResult]:
        """The answers, in the order a fleet of ``engines`` round-robin engines gives them."""
        a, c0, w0 = self.args, time.thread_time(), time.perf_counter()
        out = []
        for r in requests:
            n = max(1, min(a.max_response, int(self.rng.lognormvariate(0, 0.8) * a.median_response)))
            out.append(
                GenerationResult(
                    request_id=r.request_id,
                    prompt_ids=r.prompt_ids,
                    response_ids=self.ids[:n],
                    logprobs=self.lps[:n],
                    finish_reason="stop",
                    weight_version=self.version,
                )
            )
        lanes = [out[e :: self.engines] for e in range(self.engines)]
        ordered = [x for lane in itertools.zip_longest(*lanes) for x in lane if x is not None]
        self.prepare_cpu_s += time.thread_time() - c0
        self.prepare_wall_s += time.perf_counter() - w0
        return ordered

    def generate(self, requests):
        yield from self.prepare(requests)


class FakeReplicas:
    """``LeaderReplica``'s calls: a remote micro-batch is pickled as ``DispatchChannel.send`` does."""

    def __init__(self, engine: FakeFleet) -> None:
        self.engine, self.dispatch = engine, object()  # a channel: the dispatcher thread runs
        self.shipped_bytes, self.pickle_s, self.count = 0, 0.0, 0
        self.kept: list = []  # every 8th remote micro-batch: sized with and without samples afterwards
        self._lock = threading.Lock()

    def train_micro_batch(self, mb) -> None:
        if mb.replica == 0:
            return
        start = time.thread_time()
        payload = pickle.dumps(("train_micro_batch", (shipped(mb),)))
        with self._lock:
            self.pickle_s += time.thread_time() - start
            self.shipped_bytes += len(payload)
            self.count += 1
            if self.count % 8 == 1:
                self.kept.append(mb)

    def samples_factors(self) -> tuple[float, float]:
        """(bytes, pickling seconds) of the kept micro-batches shipped with their Sample records,
        over the same shipped without them (``replica.shipped``): the cost before / after."""
        sizes, seconds = [0, 0], [0.0, 0.0]
        for mb in self.kept:
            for i, message in enumerate((mb, shipped(mb))):
                start = time.thread_time()
                sizes[i] += len(pickle.dumps(("train_micro_batch", (message,))))
                seconds[i] += time.thread_time() - start
        return sizes[0] / max(sizes[1], 1), seconds[0] / max(seconds[1], 1e-9)

    def optimizer_step(self) -> None:
        pass

    def sync_weights(self, version: int) -> int:
        self.engine.load_weights(None, version)
        return version


def _timed_packing():
    """Wrap ``make_micro_batch`` (as the pipeline calls it) with a clock; returns the seconds box."""
    from megatron_rl.pipeline import batching

    box = [0.0]
    inner = records_mod.make_micro_batch

    def timed(*a, **k):
        start = time.thread_time()  # CPU of the calling thread: robust to a loaded machine
        try:
            return inner(*a, **k)
        finally:
            box[0] += time.thread_time() - start

    batching.make_micro_batch = timed
    return box


def run(args: argparse.Namespace) -> dict:
    """Drive the pipeline and dispatcher over the fake fleet; the figures."""
    fleet, pack_s = FakeFleet(args), _timed_packing()
    reward = busy_reward
    if args.reward_workers:
        from megatron_rl.rewards.pool import RewardPool

        reward = RewardPool(
            "megatron_rl.bench.benchmarks.dispatcher:busy_reward", workers=args.reward_workers, timeout_s=600.0
        )
    inputs = RolloutInputs(
        engine=fleet,
        prompts=_Prompts(args.prompts, args.prompt_len, args.reward_ms / 1e3),
        generator=SingleTurnGenerator(
            sampling=SamplingSettings(max_new_tokens=args.max_response), detokenize=lambda ids: "x" * len(ids)
        ),
        reward_fn=reward,
        controller=FixedController(args.group_size),
        scoring=GroupScoring(),
    )
    settings = PipelineSettings(mode="periodic", seed=1, micro_batch_tokens=args.micro_batch_tokens, queue_size=4096)
    pipe = Pipeline(inputs, settings, StepSpan(num_steps=args.steps), replicas=args.replicas)
    replicas = FakeReplicas(fleet)
    cpu, wall, tokens = _run_steps(pipe, replicas, args)
    if args.reward_workers:
        reward.close()
    clock = _Clock(cpu=cpu - fleet.prepare_cpu_s, wall=wall - fleet.prepare_wall_s, tokens=tokens, pack_s=pack_s[0])
    return _report(args, replicas, clock)


def _run_steps(pipe, replicas: FakeReplicas, args: argparse.Namespace) -> tuple[float, float, int]:
    """Run ``args.steps`` steps of ``pipe`` into ``replicas``: (rank-0 CPU s, wall s, tokens trained)."""
    cpu, wall, tokens = 0.0, 0.0, 0
    with pipe:
        for _ in range(args.steps):
            c0, w0 = time.process_time(), time.perf_counter()
            summary, _ = run_step(pipe, replicas)
            cpu, wall = cpu + time.process_time() - c0, wall + time.perf_counter() - w0
            tokens += summary.trained_response_tokens + summary.trained_groups * args.prompt_len
    return cpu, wall, tokens


@dataclass(frozen=True)
class _Clock:
    """What the steps cost rank 0: CPU and wall seconds (engine preparation taken off), tokens
    trained, CPU seconds spent packing micro-batches."""

    cpu: float
    wall: float
    tokens: int
    pack_s: float


def _report(args: argparse.Namespace, replicas: FakeReplicas, clock: _Clock) -> dict:
    """The JSON line's figures."""
    cpu, wall, tokens = clock.cpu, clock.wall, clock.tokens
    bytes_factor, pickle_factor = replicas.samples_factors()
    per_m = 1e6 / max(tokens, 1)
    return {
        "replicas": args.replicas,
        "engines": args.engines,
        "prompts": args.prompts,
        "group_size": args.group_size,
        "steps": args.steps,
        "tokens_per_step": tokens // args.steps,
        "step_s": wall / args.steps,
        "groups_per_s": args.prompts * args.steps / wall,
        "mb_per_s": replicas.shipped_bytes / 1e6 / wall,
        "rank0_cpu_s_per_step": cpu / args.steps,
        "rank0_cpu_s_per_1m_tokens": cpu * per_m,
        "shipped_mb_per_1m_tokens": replicas.shipped_bytes / 1e6 * per_m,
        "with_samples_mb_per_1m_tokens": replicas.shipped_bytes / 1e6 * per_m * bytes_factor,
        "pack_s_per_1m_tokens": clock.pack_s * per_m,
        "pickle_s_per_1m_tokens": replicas.pickle_s * per_m,
        "with_samples_pickle_s_per_1m_tokens": replicas.pickle_s * per_m * pickle_factor,
        "reward_ms": args.reward_ms,
        "reward_workers": args.reward_workers,
    }
