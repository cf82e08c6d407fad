"""The ``vllm`` worker's side of in-flight weight updates (``rollout.in_flight``): pause, resume,
and the tokens a request carries across an update.

vLLM 0.32 has no in-place pause of a request that keeps its KV blocks usable under new weights,
and this project recomputes them anyway (``rollout.in_flight``: every token's log-prob must be
that of the version it records). So an update takes the running requests *out* of the engine
(``abort`` after reading each one's tokens and log-probs so far from its last step output, vLLM's
default cumulative output kind), loads the weights (the prefix cache is reset with no request
holding blocks), and adds each request again with prompt + tokens so far as its prompt and the
remaining token budget: the engine prefills that with the new weights, and the answer is the
carried tokens followed by the new ones, each with its version. A request older than the bound
(``in_flight.too_stale``) is added again as it first came (its tokens dropped). A request carried
on keeps its seed moved by the tokens it had, so its continuation does not replay the uniforms of
its beginning.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_rl.rollout.in_flight import too_stale
from megatron_rl.rollout.types import GenerationRequest, GenerationResult, compact_token_versions


@dataclass(frozen=True)
class Carried:
    """What a request had when an update paused it, and the version its current segment runs."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    versions: tuple[int, ...] = ()
    segment_version: int = 0


@dataclass(frozen=True)
class Paused:
    """A request taken out of the engine for an update."""

    request: GenerationRequest  # as it first came
    first_version: int  # the version of its first token (its submit version when it has none)
    carried: Carried


class VLLMInFlight:
    """Per engine request: its last output and what it carries (module doc)."""

    def __init__(self) -> None:
        self.latest: dict[str, object] = {}  # engine id -> last RequestOutput of a running request
        self.carried: dict[str, Carried] = {}  # engine id -> tokens from before the last update

    def paused(self, pending: dict[str, tuple[GenerationRequest, int]]) -> list[Paused]:
        """Every pending request with the tokens it has now (the engine is about to drop them)."""
        out = []
        for engine_id, (r, first) in pending.items():
            before = self.carried.get(engine_id, Carried(segment_version=first))
            tokens, logprobs = _so_far(self.latest.get(engine_id))
            carried = Carried(
                tokens=before.tokens + tokens,
                logprobs=before.logprobs + logprobs,
                versions=before.versions + (before.segment_version,) * len(tokens),
            )
            out.append(Paused(request=r, first_version=first, carried=carried))
        self.latest.clear()
        self.carried.clear()
        return out

    def resumed(self, p: Paused, version: int, max_staleness: int) -> tuple[GenerationRequest, int, Carried | None]:
        """(request to add, its first version, what it carries or None) for ``p`` at ``version``."""
        c = p.carried
        if not c.tokens or too_stale(p.first_version, version, max_staleness):
            return p.request, version, None
        s = p.request.sampling
        sampling = dataclasses.replace(
            s,
            max_new_tokens=s.max_new_tokens - len(c.tokens),
            seed=None if s.seed is None else s.seed + len(c.tokens),
        )
        extended = GenerationRequest(
            request_id=p.request.request_id, prompt_ids=p.request.prompt_ids + c.tokens, sampling=sampling
        )
        return extended, p.first_version, dataclasses.replace(c, segment_version=version)

    def aborted(self, engine_id: str, request: GenerationRequest, first_version: int) -> GenerationResult:
        """The ``"abort"`` answer of a request dropped from the engine: every token it had (those
        carried across updates, then its current segment's), each with its version."""
        before = self.carried.pop(engine_id, Carried(segment_version=first_version))
        tokens, logprobs = _so_far(self.latest.pop(engine_id, None))
        versions = before.versions + (before.segment_version,) * len(tokens)
        return GenerationResult(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            response_ids=before.tokens + tokens,
            logprobs=before.logprobs + logprobs,
            finish_reason="abort",
            weight_version=first_version,
            token_versions=compact_token_versions(versions),
        )

    def finish(self, engine_id: str, result: GenerationResult) -> GenerationResult:
        """``result`` of the engine's last segment, with the tokens the request carried put first."""
        self.latest.pop(engine_id, None)
        c = self.carried.pop(engine_id, None)
        if c is None:
            return result
        versions = c.versions + (c.segment_version,) * len(result.response_ids)
        return dataclasses.replace(
            result,
            response_ids=c.tokens + result.response_ids,
            logprobs=c.logprobs + result.logprobs,
            token_versions=compact_token_versions(versions),
        )


def _so_far(last) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(tokens, log-probs) of a running request's last cumulative ``RequestOutput`` (None: none yet)."""
    if last is None:
        return (), ()
    completion = last.outputs[0]
    tokens = tuple(completion.token_ids)
    return tokens, tuple(step[t].logprob for step, t in zip(completion.logprobs or (), tokens, strict=True))
