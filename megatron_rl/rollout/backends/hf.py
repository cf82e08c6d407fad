"""The ``hf`` engine (runs inside a worker process): transformers model, own batched decode loop.

Prompts are left-padded with an attention mask and explicit position ids, prefilled once,
then decoded one token per step with the model's KV cache; rows leave the batch (and the
cache) as soon as they finish, and their results are yielded at once. Sampling follows
``megatron_rl.rollout.sampling`` (greedy at temperature 0, behaviour log-probs of the
temperature-scaled distribution before top-p, one uniform per token from the request's own
``torch.Generator``), so a request with a seed gives the same sample in any batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from megatron_rl.rollout.backends.hf_experts import model_slot
from megatron_rl.rollout.backends.hf_in_flight import HFInFlight
from megatron_rl.rollout.backends.hf_routes import RouteRecorder
from megatron_rl.rollout.sampling import sample_next
from megatron_rl.rollout.scoring import ScoreRequest, ScoreResult
from megatron_rl.rollout.types import GenerationRequest, GenerationResult, RoutedExperts
from megatron_rl.rollout.worker import WorkerSpec


class HFBackend:
    """``WorkerBackend`` over ``transformers.AutoModelForCausalLM``."""

    streams_weights = True  # load_tensors copies each tensor in place before taking the next
    # Set by a chunked worker (rollout.worker): called between decode steps, returns every request
    # id an Abort named so far; a running row among them ends with finish_reason "abort".
    between_steps: Callable[[], set[str]] | None = None

    def __init__(self, spec: WorkerSpec):
        from transformers import AutoModelForCausalLM

        if spec.device.kind == "cpu" and spec.device.ids:
            torch.set_num_threads(len(spec.device.ids))
        # After prepare_process the visible devices are renumbered from 0.
        self._device = torch.device("cpu" if spec.device.kind == "cpu" else f"{spec.device.kind}:0")
        self._model = (
            AutoModelForCausalLM.from_pretrained(
                spec.model_path, dtype=getattr(torch, spec.dtype), **dict(spec.backend_kwargs)
            )
            .to(self._device)
            .eval()
        )
        self._seeds = torch.Generator().manual_seed(spec.seed)  # for requests without a seed
        # algorithm.routing_replay: record the experts every forwarded token was routed to.
        self._routes = RouteRecorder(self._model) if spec.return_routed_experts else None
        # rollout.in_flight_updates: updates land between decode steps (rollout.in_flight)
        self.in_flight_staleness = spec.in_flight_staleness
        self._flight = HFInFlight()

    @property
    def device(self) -> torch.device:
        return next(self._model.parameters()).device

    @torch.no_grad()
    def load_tensors(self, named_tensors, *, source: str = "weight sync") -> None:
        """Copy HF-named tensors into the model in place; every parameter must be covered, but
        in a partial update (``weight_sync.is_partial``: LoRA's merged layers), which keeps the rest."""
        from megatron_rl.weight_sync import is_partial

        targets = self._model.state_dict()
        loaded: set[int] = set()
        for name, tensor in named_tensors:
            # an MoE expert's own matrix lands in its slice of the model's fused expert tensor
            slot = model_slot(name, targets)
            if slot is None:
                raise ValueError(f"{source}: tensor {name!r} is not a parameter of the rollout model")
            target_name, target = slot
            if tensor.shape != target.shape:
                raise ValueError(
                    f"{source}: {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(targets[target_name].data_ptr())
        missing = [n for n, p in self._model.named_parameters() if p.data_ptr() not in loaded]
        if missing and not is_partial(named_tensors):
            raise ValueError(f"{source} lacks parameters {missing[:5]} ({len(missing)} in all)")

    def generate(self, requests: Sequence[GenerationRequest], weight_version: int) -> Iterator[GenerationResult]:
        """Decode ``requests`` as one batch; yield each result as soon as its row finishes."""
        routes: list[list[torch.Tensor]] = [[] for _ in requests]  # per request: [n, layers, top_k] chunks
        self._flight.start(weight_version, len(requests))
        for row, tokens, logprobs, reason in self._decode(requests, routes):
            r = requests[row]
            first, versions = self._flight.token_versions(row, weight_version, self.in_flight_staleness)
            yield GenerationResult(
                token_versions=versions,
                request_id=r.request_id,
                prompt_ids=r.prompt_ids,
                response_ids=tuple(tokens),
                logprobs=tuple(logprobs),
                finish_reason=reason,
                weight_version=first,
                routed_experts=RoutedExperts(torch.cat(routes[row]).numpy()) if self._routes else None,
            )

    def score(self, requests: Sequence[ScoreRequest], weight_version: int) -> Iterator[ScoreResult]:
        """Teacher-forced log-probs of each request's response (``rollout.scoring``)."""
        return hf_score(self._model, requests, weight_version)

    def _generators(self, requests: Sequence[GenerationRequest]) -> list[torch.Generator]:
        seeds = [
            r.sampling.seed if r.sampling.seed is not None else int(torch.randint(2**62, (), generator=self._seeds))
            for r in requests
        ]
        return [torch.Generator().manual_seed(s) for s in seeds]

    @torch.no_grad()
    def _prefill(self, requests: Sequence[GenerationRequest], routes: list[list[torch.Tensor]]):
        """The left-padded prompts through the model: (KV cache, last logits [B, V], next positions
        [B], attention mask [B, L]); with route recording on, ``routes[i]`` gets request i's prompt routes."""
        prompt_len = max(len(r.prompt_ids) for r in requests)
        ids = torch.zeros(len(requests), prompt_len, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(requests):
            ids[i, prompt_len - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, prompt_len - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self._model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        if self._routes is not None:  # the prompt's rows, left padding dropped
            prefill = self._routes.take(len(requests), prompt_len)
            for i, r in enumerate(requests):
                routes[i].append(prefill[i, prompt_len - len(r.prompt_ids) :])
        return out.past_key_values, out.logits[:, -1], positions[:, -1] + 1, mask

    def pause(self) -> None:
        """In-flight update (``rollout.in_flight``): nothing to do, it lands between decode steps."""

    def resume(self, version: int) -> int:
        """Decode on at ``version``: the live rows are prefilled again before the next step
        (``_refill``); returns how many restart (bounded staleness)."""
        return self._flight.update(version, self.in_flight_staleness)

    def _refill(self, requests: Sequence[GenerationRequest], rows: list[int], responses: list, logprobs: list):
        """After an in-flight update: the KV cache of ``rows`` recomputed with the new weights
        (prompt + tokens so far; a too-stale row restarts from its prompt); as ``_prefill``."""
        for i in self._flight.restart(rows):
            responses[i].clear()
            logprobs[i].clear()
        extended = [
            GenerationRequest(
                request_id=requests[i].request_id,
                prompt_ids=requests[i].prompt_ids + tuple(responses[i]),
                sampling=requests[i].sampling,
            )
            for i in rows
        ]
        return self._prefill(extended, [[] for _ in rows])

    def _aborted_now(self, requests: Sequence[GenerationRequest]) -> set[str]:
        """Ids of ``requests`` an Abort named so far (``between_steps``, set by the worker)."""
        if self.between_steps is None:
            return set()
        return self.between_steps() & {r.request_id for r in requests}

    @torch.no_grad()
    def _decode(
        self, requests: Sequence[GenerationRequest], routes: list[list[torch.Tensor]]
    ) -> Iterator[tuple[int, list, list, str]]:
        """Yield (row, response ids, log-probs, finish reason) per request as rows finish; with
        route recording on, ``routes[i]`` gets the routes of each token request i forwards."""
        cache, logits, next_pos, mask = self._prefill(requests, routes)
        temperature = torch.tensor([r.sampling.temperature for r in requests], device=self._device)
        top_p = torch.tensor([r.sampling.top_p for r in requests], device=self._device)
        generators = self._generators(requests)
        rows = list(range(len(requests)))  # request index of each live batch row
        responses: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        while True:
            uniforms = torch.stack([torch.rand((), generator=generators[i]) for i in rows]).to(self._device)
            tokens, lps = sample_next(logits, temperature[rows], top_p[rows], uniforms)
            sampled_by = self._flight.now(rows)  # before between_steps may load an update
            keep, aborted = [], self._aborted_now(requests)
            for j, (i, token, lp) in enumerate(zip(rows, tokens.tolist(), lps.tolist(), strict=True)):
                responses[i].append(token)
                logprobs[i].append(lp)
                self._flight.versions[i].append(sampled_by)
                reason = _end_reason(requests[i], token, len(responses[i]), aborted)
                if reason is not None:
                    yield i, responses[i], logprobs[i], reason
                else:
                    keep.append(j)
            if not keep:
                return
            if len(keep) < len(rows):
                index = torch.tensor(keep, device=self._device)
                cache.batch_select_indices(index)
                tokens, mask, next_pos = tokens[index], mask[index], next_pos[index]
                rows = [rows[j] for j in keep]
            if self._flight.version != sampled_by:  # an update was loaded: prefill the rows again
                cache, logits, next_pos, mask = self._refill(requests, rows, responses, logprobs)
                continue
            cache, logits, next_pos, mask = self._forward_step(tokens, cache, next_pos, mask, rows=rows, routes=routes)

    def _forward_step(self, tokens, cache, next_pos, mask, *, rows: list[int], routes: list[list[torch.Tensor]]):
        """One decode step: ``tokens [B]`` (the live ``rows``) through the model with the KV cache;
        (cache, logits [B, V], next positions, attention mask); routes recorded when on."""
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        out = self._model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=next_pos[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        if self._routes is not None:
            step_routes = self._routes.take(len(rows), 1)
            for j, i in enumerate(rows):
                routes[i].append(step_routes[j])
        return out.past_key_values, out.logits[:, -1], next_pos + 1, mask


def _end_reason(request: GenerationRequest, token: int, length: int, aborted: set[str]) -> str | None:
    """Why a row ends after sampling ``token`` as its ``length``-th: stop, length, abort, or None."""
    s = request.sampling
    if token in s.stop_token_ids:
        return "stop"
    if length >= s.max_new_tokens:
        return "length"
    return "abort" if request.request_id in aborted else None


def hf_score(model, requests: Sequence[ScoreRequest], weight_version: int) -> Iterator[ScoreResult]:
    """Teacher-forced log-probs from a transformers causal LM, one forward per request."""
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        for r in requests:
            ids = torch.tensor([r.prompt_ids + r.response_ids], device=device)
            n = len(r.prompt_ids)
            logits = model(input_ids=ids).logits[0, n - 1 : -1].float()  # [Lr, V]: position t predicts t + 1
            lp = torch.log_softmax(logits / r.temperature, dim=-1).gather(-1, ids[0, n:, None])[:, 0]
            yield ScoreResult(request_id=r.request_id, logprobs=tuple(lp.tolist()), weight_version=weight_version)
