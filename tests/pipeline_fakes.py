"""Test doubles for the pipeline: a deterministic rollout engine, prompts, rewards, a trainer.

FakeEngine: a result's tokens are a function of (request seed, weight version) only
(``sample_tokens``); results come back in a shuffled completion order (seeded per call); optional
per-result delay and failure injection. FakeTrainer records what it is given and syncs the
engine in ``sync_weights`` the way the real trainer must; ``train_one_step`` is the training
loop's body (``trainer.loop.train``) over them.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from dataclasses import dataclass

from megatron_rl.control import FixedController
from megatron_rl.generation import SingleTurnGenerator
from megatron_rl.pipeline import (
    BatchSummary,
    GroupScoring,
    MicroBatch,
    Pipeline,
    PipelineSettings,
    RolloutInputs,
    StepSpan,
)
from megatron_rl.rollout.types import GenerationRequest, GenerationResult, SamplingSettings
from megatron_rl.weight_sync.snapshot import SnapshotUpdate

MAX_NEW_TOKENS = 6


def sample_tokens(seed: int, version: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The fake engine's sample for a request seed under a weight version: (tokens, log-probs)."""
    rng = random.Random(f"{seed}:{version}")
    n = rng.randint(1, MAX_NEW_TOKENS)
    tokens = tuple(rng.randrange(3, 50) for _ in range(n))
    return tokens, tuple(-rng.random() for _ in range(n))


class FakeEngine:
    """Deterministic ``RolloutEngine`` with shuffled completion order, delays and failures."""

    def __init__(
        self,
        *,
        version: int = 0,
        order_seed: int = 0,
        delay_s: float = 0.0,
        fail_after: int | None = None,
        block_after: int | None = None,
    ) -> None:
        self._version, self._lock = version, threading.Lock()
        self.order_seed, self.delay_s, self.fail_after, self.block_after = order_seed, delay_s, fail_after, block_after
        self.calls: list[tuple[int, int]] = []  # (step of the requests, engine version at the call)
        self.results: list[GenerationResult] = []
        self.updates: list[int] = []
        self.shutdown_calls = 0
        self._shut = threading.Event()

    @property
    def weight_version(self) -> int:
        with self._lock:
            return self._version

    def load_weights(self, update, version: int) -> None:
        with self._lock:
            self._version = version
            self.updates.append(version)

    def shutdown(self) -> None:
        self.shutdown_calls += 1
        self._shut.set()

    def generate(self, requests):
        self.calls.append((int(requests[0].request_id.split("/")[0]), self.weight_version))
        order = list(range(len(requests)))
        random.Random(self.order_seed * 1000 + len(self.calls)).shuffle(order)
        for n, idx in enumerate(order):
            if self.fail_after is not None and n >= self.fail_after:
                raise RuntimeError("engine exploded")
            if self.block_after is not None and n >= self.block_after:
                self._shut.wait()  # a stuck worker: only shutdown() releases it
                raise RuntimeError("engine shut down while generating")
            time.sleep(self.delay_s)
            result = self._answer(requests[idx])
            self.results.append(result)
            yield result

    def _answer(self, req: GenerationRequest) -> GenerationResult:
        version = self.weight_version
        tokens, logprobs = sample_tokens(req.sampling.seed, version)
        return GenerationResult(
            request_id=req.request_id,
            prompt_ids=req.prompt_ids,
            response_ids=tokens,
            logprobs=logprobs,
            finish_reason="length" if len(tokens) == MAX_NEW_TOKENS else "stop",
            weight_version=version,
        )


@dataclass(frozen=True, kw_only=True)
class FakeRecord:
    prompt_id: str
    answer: str = ""


@dataclass(frozen=True, kw_only=True)
class FakeItem:
    record: FakeRecord
    token_ids: tuple[int, ...]


class FakePrompts:
    """Consecutive slices of ``ids`` (cyclic), with a ``state_dict``."""

    def __init__(self, ids: list[str], per_batch: int) -> None:
        self.items = [
            FakeItem(record=FakeRecord(prompt_id=p), token_ids=(1, 2 + i % 5, 7)[: 1 + i % 3])
            for i, p in enumerate(ids)
        ]
        self.per_batch, self.position = per_batch, 0

    def next_batch(self) -> list[FakeItem]:
        out = [self.items[(self.position + j) % len(self.items)] for j in range(self.per_batch)]
        self.position += self.per_batch
        return out

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}


def detokenize(ids) -> str:
    return " ".join(str(t) for t in ids)


def parity_reward(record: FakeRecord, text: str) -> float:
    """1 if the first token is even, else 0; prompts named "const*" always score 0.5."""
    if record.prompt_id.startswith("const"):
        return 0.5
    return float(int(text.split()[0]) % 2 == 0)


class FakeTrainer:
    """Records micro-batches and optimizer steps; ``sync_weights`` syncs the engine to ``version``.

    ``lead=(k, batches)``: before moving the engine from version v-1 to v, wait until a result of
    batch v-1+k (while it is < batches) has come out, so stale mode runs exactly k batches ahead
    whatever else the machine is doing (a sleeping trainer only makes it likely)."""

    def __init__(
        self,
        engine: FakeEngine,
        *,
        sleep_s: float = 0.0,
        fail_micro_at: int | None = None,
        fail_finish_at: int | None = None,
        lead: tuple[int, int] | None = None,
    ) -> None:
        self.engine, self.sleep_s, self.lead = engine, sleep_s, lead
        self.fail_micro_at, self.fail_finish_at = fail_micro_at, fail_finish_at
        self.micro_batches: list[MicroBatch] = []
        self.steps: list[int] = []  # micro-batches trained before each optimizer step (cumulative)
        self.syncs: list[int] = []

    def train_micro_batch(self, mb: MicroBatch) -> None:
        time.sleep(self.sleep_s)
        if self.fail_micro_at is not None and len(self.micro_batches) == self.fail_micro_at:
            raise ValueError("trainer exploded")
        self.micro_batches.append(mb)

    def optimizer_step(self) -> None:
        self.steps.append(len(self.micro_batches))

    def sync_weights(self, version: int) -> int:
        if self.fail_finish_at is not None and len(self.syncs) == self.fail_finish_at:
            raise ValueError("optimizer exploded")
        self.syncs.append(version)
        if self.lead is not None:
            lead, batches = self.lead
            hold_until_ahead(self.engine.results, version, lead=lead, batches=batches, timeout_s=30.0)
        self.engine.load_weights(SnapshotUpdate(f"/snapshots/{version}"), version)
        return version


def hold_until_ahead(results: list, version: int, *, lead: int, batches: int, count: int = 1, timeout_s: float) -> None:
    """Before an engine moves from version v-1 to ``version`` = v: block until ``results`` (appended
    to by the producer's thread) hold ``count`` results of batch v-1+``lead``, all sampled at v-1,
    so stale mode runs exactly ``lead`` batches ahead however the cores are shared. Nothing to wait
    for once that batch is past the run's ``batches``; ``TimeoutError`` naming it after ``timeout_s``."""
    ahead = version - 1 + lead
    if ahead >= batches:
        return
    give_up = time.monotonic() + timeout_s
    while sum(int(r.request_id.split("/")[0]) == ahead for r in list(results)) < count:
        if time.monotonic() > give_up:
            raise TimeoutError(
                f"fewer than {count} results of batch {ahead} after {timeout_s:.0f} s at version "
                f"{version - 1}: the producer did not run {lead} batches ahead"
            )
        time.sleep(0.002)


def train_one_step(pipe: Pipeline, trainer) -> BatchSummary:
    """The training loop's body (``trainer.loop.train``); an error aborts the pipeline as leaving
    the loop's ``with pipeline:`` block does."""
    try:
        batch = pipe.begin_step()
        for mini_batch in batch.mini_batches():
            for micro_batch in mini_batch:
                trainer.train_micro_batch(micro_batch)
            trainer.optimizer_step()
        return pipe.complete(batch, trainer.sync_weights(batch.policy_version + 1))
    except BaseException:
        pipe.abort()
        raise


def make_pipeline(
    engine,
    *,
    mode="periodic",
    max_staleness=0,
    prompts=None,
    controller=None,
    num_steps=3,
    queue_size=64,
    dynamic_sampling=False,
    tokens=4096,
    flush_when_idle=True,
    reward_fn=parity_reward,
    mini_batches=1,
    record=None,
    target_groups=None,
    carry_over=None,
    generator=None,
) -> Pipeline:
    """A pipeline over 6 prompts per batch (G = 4 unless ``controller`` says otherwise)."""
    inputs = RolloutInputs(
        engine=engine,
        prompts=prompts or FakePrompts([f"p{i}" for i in range(12)], per_batch=6),
        generator=generator or single_turn(),
        reward_fn=reward_fn,
        controller=controller or FixedController(4),
        scoring=GroupScoring(dynamic_sampling=dynamic_sampling, target_groups=target_groups),
        carry_over=carry_over,
    )
    settings = PipelineSettings(
        mode=mode,
        max_staleness=max_staleness,
        queue_size=queue_size,
        seed=7,
        micro_batch_tokens=tokens,
        flush_when_idle=flush_when_idle,
        poll_s=0.01,
        mini_batches=mini_batches,
        join_timeout_s=5.0,
    )
    return Pipeline(inputs, settings, StepSpan(num_steps=num_steps), record=record)


def single_turn() -> SingleTurnGenerator:
    """The single-turn generator of the fakes: ``MAX_NEW_TOKENS``, responses as ``detokenize`` text."""
    return SingleTurnGenerator(sampling=SamplingSettings(max_new_tokens=MAX_NEW_TOKENS), detokenize=detokenize)


def producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "megatron_rl-producer"]


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (TimeoutError in the main thread) instead of hanging past ``seconds``."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"test ran past {seconds} s: the pipeline probably hangs")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
