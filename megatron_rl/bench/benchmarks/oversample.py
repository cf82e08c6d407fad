"""DAPO over-sampling step time with and without abort, side by side (hf engine, tiny model).

    python -m megatron_rl bench oversample [--prompts 4] [--oversample 2] [--group-size 4]
                                           [--median 16] [--max-new 128] [--steps 3]

A batch trains ``--prompts`` groups drawn from ``--prompts`` x ``--oversample`` prompts
(``algorithm.oversample``, dynamic sampling on). The tiny random char Llama decodes with a stop
set sized so that response lengths are geometric around ``--median`` tokens and cut at
``--max-new`` (8x the median: the heavy-tailed shape of long reasoning answers). Each step is run
twice on the same engine, alternating: ``abort`` (the producer aborts the prompts it will not
train once the first N kept groups are known) and ``no_abort`` (the same over-sampling with the
engine's abort a no-op: the step waits for every drawn request). Both must train the same groups
(checked: the benchmark fails otherwise). Prints one JSON line: per mode the mean step
generation seconds, tokens decoded per step (aborted partials included) and prompts aborted;
``speedup`` = no_abort / abort step time; and the response-length median / max seen.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time

from megatron_rl.bench.benchmarks import BenchmarkFailed
from megatron_rl.bench.synthetic_prompts import parity_reward, random_prompts


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The workload: prompts trained per step, over-sampling factor, G, lengths, steps."""
    p.add_argument("--prompts", type=int, default=4, help="groups trained per step (N)")
    p.add_argument("--oversample", type=float, default=2.0)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--median", type=int, default=16, help="target median response length")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)


class _Prompts:
    """``count`` fixed random prompts per step, different every step."""

    def __init__(self, count: int, vocab: int, step: int) -> None:
        self._items = random_prompts(random.Random(step), step=step, count=count, vocab=vocab)

    def next_batch(self):
        return self._items


class _Counting:
    """Wraps the pool: counts decoded tokens; ``aborts`` False makes ``abort`` a no-op."""

    def __init__(self, pool, *, aborts: bool) -> None:
        self.pool, self.aborts, self.tokens, self.aborted = pool, aborts, 0, 0

    def generate(self, requests):
        for result in self.pool.generate(requests):
            self.tokens += len(result.response_ids)
            yield result

    def abort(self, ids) -> None:
        self.aborted += len(ids)
        if self.aborts:
            self.pool.abort(ids)

    def shutdown(self) -> None:
        """A pipeline shuts its engine down when it closes: this one outlives each step."""

    def __getattr__(self, name):
        return getattr(self.pool, name)


def _step(engine, args, step: int, vocab: int, stop: tuple[int, ...]) -> tuple[float, list]:
    """One over-sampled DAPO step on ``engine``: (generation seconds, the trained groups)."""
    from megatron_rl.control import FixedController
    from megatron_rl.generation import SingleTurnGenerator
    from megatron_rl.pipeline import GroupScoring, Pipeline, PipelineSettings, RolloutInputs, StepSpan
    from megatron_rl.rollout.types import SamplingSettings

    drawn = math.ceil(round(args.prompts * args.oversample, 9))
    sampling = SamplingSettings(max_new_tokens=args.max_new, stop_token_ids=stop)
    inputs = RolloutInputs(
        engine=engine,
        prompts=_Prompts(drawn, vocab, step),
        generator=SingleTurnGenerator(sampling=sampling, detokenize=lambda ids: "x" * len(ids)),
        reward_fn=parity_reward,
        controller=FixedController(args.group_size),
        scoring=GroupScoring(dynamic_sampling=True, target_groups=args.prompts),
    )
    settings = PipelineSettings(
        mode="periodic", max_staleness=0, queue_size=4 * drawn, seed=args.seed, micro_batch_tokens=1 << 20,
        flush_when_idle=False, poll_s=0.01, mini_batches=1, join_timeout_s=30.0,
    )  # fmt: skip
    start = time.perf_counter()
    with Pipeline(inputs, settings, StepSpan(num_steps=1, start_step=step)) as pipe:
        batch = pipe.begin_step()
        groups = [g for mini in batch.mini_batches() for mb in mini for g in mb.groups]
        end = batch.finish()  # one step: no weight sync, the pipeline closes here
    trained = sorted((g.prompt_index, tuple(s.response_ids for s in g.samples)) for g in groups)
    return end.generation_s or time.perf_counter() - start, trained


def run(args: argparse.Namespace) -> dict:
    """Alternate abort / no_abort steps on one hf engine; the JSON line (module doc)."""
    from megatron_rl.models.synthetic import write_char_llama
    from megatron_rl.rollout import EngineSettings, build_engine

    with tempfile.TemporaryDirectory(prefix="megatron_rl-bench-oversample-") as tmp:
        model = write_char_llama(f"{tmp}/model", seed=args.seed)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size
        stop = tuple(range(3, 3 + max(1, round(vocab * math.log(2) / args.median))))
        pool = build_engine(
            EngineSettings(engine="hf", model_path=str(model), dtype="float32", num_engines=1, max_batch_size=256)
        )
        try:
            return _measure(pool, args, vocab, stop)
        finally:
            pool.shutdown()


def _measure(pool, args, vocab: int, stop: tuple[int, ...]) -> dict:
    modes = {"abort": _Counting(pool, aborts=True), "no_abort": _Counting(pool, aborts=False)}
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    lengths: list[int] = []
    for step in range(args.steps):
        trained = {}
        for mode, engine in modes.items():
            s, trained[mode] = _step(engine, args, step, vocab, stop)
            seconds[mode].append(s)
        lengths += [len(r) for _, responses in trained["no_abort"] for r in responses]
        if trained["abort"] != trained["no_abort"]:
            raise BenchmarkFailed({"error": f"step {step}: abort changed the trained groups"})
    result = {"benchmark": "oversample", "prompts": args.prompts, "oversample": args.oversample}
    for mode, engine in modes.items():
        result[f"{mode}_step_s"] = round(statistics.mean(seconds[mode]), 3)
        result[f"{mode}_tokens_per_step"] = round(engine.tokens / args.steps, 1)
        result[f"{mode}_prompts_aborted_per_step"] = round(engine.aborted / args.group_size / args.steps, 2)
    result["speedup"] = round(result["no_abort_step_s"] / max(result["abort_step_s"], 1e-9), 2)
    result["trained_len_median"] = statistics.median(lengths) if lengths else 0
    result["trained_len_max"] = max(lengths, default=0)
    return result
