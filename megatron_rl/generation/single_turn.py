"""Single-turn generation: one response per (prompt, k), the whole batch in one ``generate`` call.

Every (prompt, k) request goes to the engine at once (request id ``"<step>/<prompt_id>/<k>"``,
seeded per request: ``BatchRequest.seed(prompt_id, k)``, otherwise the run's
``SamplingSettings``); each result becomes a ``Trajectory`` as it completes (engine order),
its text decoded for the reward function. DAPO overlong shaping measures each response's
length against ``algorithm.overlong``'s configured max_len.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial

from megatron_rl.generation.base import (
    BatchRequest,
    GeneratorSetup,
    MeasuredSample,
    OverlongLengths,
    Trajectory,
    register_generator,
    response_lengths,
)
from megatron_rl.rollout.types import GenerationRequest, GenerationResult, RolloutEngine, SamplingSettings

Detokenize = Callable[[Sequence[int]], str]  # response token ids -> text


class SingleTurnGenerator:
    """One ``engine.generate`` call per batch (module doc)."""

    def __init__(self, *, sampling: SamplingSettings, detokenize: Detokenize) -> None:
        self._sampling, self._detokenize = sampling, detokenize

    def run(
        self,
        engine: RolloutEngine,
        batch: BatchRequest,
        *,
        stop: threading.Event,
        check_version: Callable[[str, int], None],
    ) -> Iterator[Trajectory]:
        """Yield a ``Trajectory`` per engine result as it completes; return early once ``stop`` is set."""
        where: dict[str, tuple[int, int]] = {}
        requests = []
        for p, item in enumerate(batch.items):
            for k in range(batch.group_size):
                rid = batch.request_id(p, k)
                where[rid] = (p, k)
                sampling = replace(self._sampling, seed=batch.seed(item.record.prompt_id, k))
                requests.append(GenerationRequest(request_id=rid, prompt_ids=tuple(item.token_ids), sampling=sampling))
        for result in engine.generate(requests):
            if stop.is_set():
                return
            if result.request_id not in where:
                raise RuntimeError(f"engine returned an unknown or duplicate request id {result.request_id!r}")
            p, k = where.pop(result.request_id)
            check_version(result.request_id, result.weight_version)
            yield self._trajectory(result, p, k, tuple(batch.items[p].token_ids))

    def _trajectory(self, result: GenerationResult, p: int, k: int, prompt_ids: tuple[int, ...]) -> Trajectory:
        return Trajectory(
            request_id=result.request_id,
            prompt_index=p,
            k=k,
            prompt_ids=prompt_ids,
            response_ids=result.response_ids,
            loss_mask=None,
            behav_logprobs=result.logprobs,
            turn_versions=(result.weight_version,),
            finish_reason=result.finish_reason,
            last_text=self._detokenize(result.response_ids),
            routed_experts=result.routed_experts,
            token_versions=result.token_versions,
        )

    def overlong_lengths(self, samples: Sequence[MeasuredSample], max_len: int) -> OverlongLengths:
        """Each response's length against the configured ``max_len``."""
        return response_lengths(samples, max_len)


@register_generator("single_turn")
def build_single_turn(setup: GeneratorSetup) -> SingleTurnGenerator:
    """``rollout.sampling`` as it is; responses decoded without special tokens."""
    return SingleTurnGenerator(
        sampling=setup.sampling, detokenize=partial(setup.tokenizer.decode, skip_special_tokens=True)
    )
