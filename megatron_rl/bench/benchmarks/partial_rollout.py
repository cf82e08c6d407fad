"""Partial rollout: stale mode with and without in-flight weight updates, and periodic mode, side by side.

    python -m megatron_rl bench partial_rollout [--prompts 4] [--group-size 4] [--median 16]
                                                [--max-new 128] [--steps 4] [--train-s 0.05]

The real producer / queue / consumer (``pipeline.Pipeline``) over a real hf engine pool on a tiny
random char Llama, with response lengths geometric around ``--median`` tokens and cut at
``--max-new`` (8x the median: heavy-tailed, as long reasoning answers are; the stop set is sized
as in ``bench oversample``). The trainer is simulated: each trained micro-batch costs
``--train-s`` x its groups (a sleep: the core stays with the engine), and the step's weight sync
is a real load of the other of two checkpoints (``SnapshotUpdate``), so weights really change and
in-flight requests really recompute their KV cache. A run of ``--steps`` steps per mode (the
first not timed): ``periodic`` (on-policy), ``stale`` (``max_staleness`` 1, the sync waits for
the generate call in progress), ``stale_in_flight`` (the sync lands between decode steps), and two
DAPO modes at ``max_staleness`` 2 with in-flight updates that draw 2x ``--prompts`` prompts and
train the first ``--prompts`` kept groups (dynamic sampling): ``stale_oversample`` (the other
prompts aborted, their tokens lost) and ``stale_carry_over`` (they continue into the next batch:
``rollout.carry_over``).

Prints one JSON line: per mode the trained response tokens per second of wall time, the mean
reward per trained sample (a length-parity reward: it compares what was sampled, not learning,
since nothing is trained), and where a step's time goes: ``sync_s`` (the trainer's wait in
``load_weights``: in ``stale`` the longest answer in flight), ``wait_s`` (the consumer's wait for
groups), ``train_s``; with in-flight updates the ``partial/*`` counters, with over-sampling the
aborted groups and ``partial/carried_*`` per step. ``speedup`` is stale_in_flight tokens/s over
stale's, ``carry_over_speedup`` stale_carry_over's over stale_oversample's.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

from megatron_rl.bench.synthetic_prompts import parity_reward, random_prompts


@dataclass(frozen=True)
class _Mode:
    pipeline: str
    staleness: int
    in_flight: bool
    oversample: bool = False  # draw 2x the prompts, train the first kept groups, abort the rest (DAPO)
    carry_over: bool = False  # the aborted prompts continue into the next batch (partial rollout)


MODES = {
    "periodic": _Mode("periodic", 0, False),
    "stale": _Mode("stale", 1, False),
    "stale_in_flight": _Mode("stale", 1, True),
    "stale_oversample": _Mode("stale", 2, True, oversample=True),
    "stale_carry_over": _Mode("stale", 2, True, oversample=True, carry_over=True),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The workload: prompts and G per step, lengths, steps, simulated train time per group."""
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--median", type=int, default=16, help="target median response length")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--train-s", type=float, default=0.05, help="simulated training seconds per group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))


class _Prompts:
    """``count`` random prompts per step, different every step."""

    def __init__(self, count: int, vocab: int, seed: int) -> None:
        self._rng, self._count, self._vocab, self._step = random.Random(seed), count, vocab, 0

    def next_batch(self):
        self._step += 1
        return random_prompts(self._rng, step=self._step, count=self._count, vocab=self._vocab)


def run(args: argparse.Namespace) -> dict:
    """The three modes, one after the other, on fresh pools; the JSON line (module doc)."""
    from transformers import AutoConfig

    from megatron_rl.models.synthetic import write_char_llama

    if args.steps < 2:
        raise SystemExit(f"bench partial_rollout: --steps {args.steps}: needs 2 or more (step 0 is an untimed warm-up)")
    with tempfile.TemporaryDirectory(prefix="megatron_rl-bench-partial-") as tmp:
        checkpoints = [write_char_llama(f"{tmp}/v{i}", seed=args.seed + i) for i in range(2)]
        vocab = AutoConfig.from_pretrained(checkpoints[0]).vocab_size
        stop = tuple(range(3, 3 + max(1, round(vocab * math.log(2) / args.median))))
        result = {"benchmark": "partial_rollout", "median": args.median, "max_new": args.max_new}
        for name in args.modes.split(","):
            result |= {f"{name}_{k}": v for k, v in _run_mode(args, MODES[name], checkpoints, vocab, stop).items()}
    if "stale_tokens_per_s" in result and "stale_in_flight_tokens_per_s" in result:
        result["speedup"] = round(result["stale_in_flight_tokens_per_s"] / max(result["stale_tokens_per_s"], 1e-9), 2)
    if "stale_oversample_tokens_per_s" in result and "stale_carry_over_tokens_per_s" in result:
        carry, plain = result["stale_carry_over_tokens_per_s"], result["stale_oversample_tokens_per_s"]
        result["carry_over_speedup"] = round(carry / max(plain, 1e-9), 2)
    return result


def _run_mode(args, mode: _Mode, checkpoints, vocab: int, stop: tuple[int, ...]) -> dict:
    """``--steps`` steps of one mode on a pool of its own; its figures (module doc)."""
    from megatron_rl.rollout import EngineSettings, build_engine

    settings = EngineSettings(
        engine="hf",
        model_path=str(checkpoints[0]),
        dtype="float32",
        num_engines=1,
        max_batch_size=256,
        in_flight_updates=mode.in_flight,
        max_staleness=mode.staleness,
    )
    pool = build_engine(settings)
    try:
        return _steps(pool, args, mode, checkpoints, (vocab, stop))
    finally:
        pool.shutdown()


def _steps(pool, args, mode: _Mode, checkpoints, workload: tuple[int, tuple[int, ...]]) -> dict:
    from megatron_rl.control import FixedController
    from megatron_rl.generation import SingleTurnGenerator
    from megatron_rl.pipeline import GroupScoring, Pipeline, PipelineSettings, RolloutInputs, StepSpan
    from megatron_rl.pipeline.carry_over import CarryOver
    from megatron_rl.rollout.types import SamplingSettings
    from megatron_rl.weight_sync.snapshot import SnapshotUpdate

    vocab, stop = workload
    drawn = 2 * args.prompts if mode.oversample else args.prompts
    inputs = RolloutInputs(
        engine=pool,
        prompts=_Prompts(drawn, vocab, args.seed),
        generator=SingleTurnGenerator(
            sampling=SamplingSettings(max_new_tokens=args.max_new, stop_token_ids=stop),
            detokenize=lambda ids: "x" * len(ids),
        ),
        reward_fn=parity_reward,
        controller=FixedController(args.group_size),
        scoring=GroupScoring(dynamic_sampling=mode.oversample, target_groups=args.prompts if mode.oversample else None),
        carry_over=CarryOver(max_prompts=args.prompts, multiple=1) if mode.carry_over else None,
    )
    settings = PipelineSettings(
        mode=mode.pipeline, max_staleness=mode.staleness, queue_size=8 * drawn, seed=args.seed,
        micro_batch_tokens=1 << 20, poll_s=0.01, join_timeout_s=60.0,
    )  # fmt: skip
    seen = _Seen()
    with Pipeline(inputs, settings, StepSpan(num_steps=args.steps)) as pipe:
        for step in range(args.steps):
            seen.step(pipe, pool, args, lambda v: SnapshotUpdate(str(checkpoints[v % 2])), timed=step > 0)
    return seen.figures(pool)


class _Seen:
    """What the timed steps of one mode measured."""

    def __init__(self) -> None:
        self.wall = self.tokens = 0.0
        self.rewards: list[float] = []
        self.sync: list[float] = []
        self.wait: list[float] = []
        self.train: list[float] = []
        self.counts: dict[str, float] = {}  # over-sampling / carry-over counters summed over timed steps

    def step(self, pipe, pool, args, update, *, timed: bool) -> None:
        """One step: consume (simulated training per micro-batch), sync the other checkpoint."""
        start, train = time.perf_counter(), 0.0
        batch = pipe.begin_step()
        for mini in batch.mini_batches():
            for mb in mini:
                time.sleep(args.train_s * len(mb.groups))
                train += args.train_s * len(mb.groups)
        version = batch.policy_version + 1
        sync_start = time.perf_counter()
        pool.load_weights(update(version), version)
        sync_s = time.perf_counter() - sync_start
        summary = pipe.complete(batch, version)
        if not timed:
            pool.partial_metrics()  # count the timed steps only
            return
        self.wall += time.perf_counter() - start
        self.tokens += summary.trained_response_tokens
        self.rewards += [s.reward for g in batch.groups if g.kept for s in g.samples]
        self.sync.append(sync_s)
        self.wait.append(summary.wait_s)
        self.train.append(train)
        for key, value in summary.end.control_metrics.items():
            if key.startswith("partial/carried_") or key == "control/aborted_groups":
                self.counts[key] = self.counts.get(key, 0.0) + value

    def figures(self, pool) -> dict:
        """This mode's JSON fields."""
        out = {
            "tokens_per_s": round(self.tokens / max(self.wall, 1e-9), 1),
            "reward_per_sample": round(statistics.mean(self.rewards), 3) if self.rewards else 0.0,
            "step_s": round(self.wall / max(len(self.sync), 1), 3),
            "sync_s": round(statistics.mean(self.sync), 3),
            "wait_s": round(statistics.mean(self.wait), 3),
            "train_s": round(statistics.mean(self.train), 3),
        }
        steps = max(len(self.sync), 1)
        out |= {k.split("/")[1] + "_per_step": round(v / steps, 2) for k, v in self.counts.items()}
        return out | {k.replace("partial/", "partial_"): v for k, v in pool.partial_metrics().items()}
