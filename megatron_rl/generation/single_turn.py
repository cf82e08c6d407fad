"""Single-turn generation: one response per (prompt, k), the whole batch in one ``generate`` call.

Every (prompt, k) request goes to the engine at once (request id ``"<step>/<prompt_id>/<k>"``,
seeded per request: ``BatchRequest.seed(prompt_id, k)``, otherwise the run's
``SamplingSettings``); each result becomes a ``Trajectory`` as it completes (engine order),
its text decoded for the reward function. DAPO overlong shaping measures each response's
length against ``algorithm.overlong``'s configured max_len.

Partial rollout (``BatchRequest.carried``, ``pipeline.carry_over``): a (prompt, k) an earlier batch
finished is yielded as it was (renamed into this batch); one it aborted is sent again as prompt +
its tokens so far with the budget they leave, and its answer is those tokens followed by the new
ones, each with the version that sampled it (the first token's is the trajectory's version).
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
from megatron_rl.rollout.types import (
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    SamplingSettings,
    compact_token_versions,
)

Detokenize = Callable[[Sequence[int]], str]  # response token ids -> text


class SingleTurnGenerator:
    """One ``engine.generate`` call per batch (module doc)."""

    continues_partial = True  # BatchRequest.carried: finished trajectories re-yielded, aborted ones continued

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
        """Yield a ``Trajectory`` per (prompt, k): the carried finished ones first, then each engine
        result as it completes; return early once ``stop`` is set."""
        where: dict[str, tuple[int, int, Trajectory | None]] = {}
        requests, finished = [], []
        for p, item in enumerate(batch.items):
            for k in range(batch.group_size):
                rid, prior = batch.request_id(p, k), batch.carried.get((p, k))
                if prior is not None and self._is_finished(prior):
                    reason = "length" if prior.finish_reason == "abort" else prior.finish_reason
                    finished.append(replace(prior, request_id=rid, prompt_index=p, k=k, finish_reason=reason))
                    continue
                where[rid] = (p, k, prior)
                requests.append(self._request(rid, tuple(item.token_ids), batch.seed(item.record.prompt_id, k), prior))
        for trajectory in finished:
            check_version(trajectory.request_id, trajectory.turn_versions[0])
            yield trajectory
        for result in engine.generate(requests) if requests else ():
            if stop.is_set():
                return
            if result.request_id not in where:
                raise RuntimeError(f"engine returned an unknown or duplicate request id {result.request_id!r}")
            p, k, prior = where.pop(result.request_id)
            if prior is not None:
                result = _continued(prior, result)
            check_version(result.request_id, result.weight_version)
            yield self._trajectory(result, p, k, tuple(batch.items[p].token_ids))

    def _is_finished(self, prior: Trajectory) -> bool:
        """Whether a carried trajectory needs no more tokens (an abort at the budget counts)."""
        return prior.finish_reason != "abort" or len(prior.response_ids) >= self._sampling.max_new_tokens

    def _request(self, rid: str, prompt_ids: tuple[int, ...], seed: int, prior: Trajectory | None) -> GenerationRequest:
        """The engine request of one (p, k): its prompt, or prompt + the carried tokens with the
        budget they leave."""
        sampling = replace(self._sampling, seed=seed)
        if prior is None:
            return GenerationRequest(request_id=rid, prompt_ids=prompt_ids, sampling=sampling)
        sampling = replace(sampling, max_new_tokens=sampling.max_new_tokens - len(prior.response_ids))
        return GenerationRequest(request_id=rid, prompt_ids=prompt_ids + prior.response_ids, sampling=sampling)

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


def _continued(prior: Trajectory, result: GenerationResult) -> GenerationResult:
    """``result`` of a carried request's continuation, its carried tokens put first, each token
    with the version that sampled it; its ``weight_version`` is the first token's."""
    if prior.routed_experts is not None or result.routed_experts is not None:
        raise RuntimeError(f"{result.request_id!r}: a carried-over request cannot merge MoE routes (routing replay)")
    versions = (prior.token_versions or prior.turn_versions * len(prior.response_ids)) + result.versions_per_token
    return replace(
        result,
        response_ids=prior.response_ids + result.response_ids,
        logprobs=prior.behav_logprobs + result.logprobs,
        weight_version=versions[0] if versions else result.weight_version,
        token_versions=compact_token_versions(versions),
    )
