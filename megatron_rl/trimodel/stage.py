"""One pipeline stage of the tri-model: three copies that megatron's schedule sees as one model.

``TriStage`` wraps this rank's stage of the policy (trainable, possibly DDP-wrapped) and of
the active frozen copies (old, ref). Contract with megatron-core 0.16's schedules:

- ``set_input_tensor([x])`` gets the activation received from the previous stage, the
  hidden streams of the active copies side by side on the batch dim: ``[s, n·b, h]``
  (``[T, n, h]`` for one packed micro-batch, n = 1..3, policy first). It is split into n
  chunks, kept per stream and handed to the stream module's ``set_input_tensor`` right before
  that stream's forward (with LoRA one module computes several streams).
- ``forward(mb)`` runs the policy with grad and the frozen copies under ``no_grad`` on the
  packed micro-batch ``mb``; a ``shared`` copy (LoRA) is the policy's module under a switch
  (``lora.switch``: adapters off for the reference, the adapter snapshot for the old policy).
  A non-last stage returns ``torch.cat(hidden, dim=1)`` (the tensor sent on); the last stage
  returns ``TriLogprobs`` (each copy's logits are reduced to per-token log-probs right away, so
  at most one copy's ``[T, V/tp]`` logits live at a time).
- Context parallelism (megatron's CP size > 1): the stage feeds the model this CP rank's
  per-segment zigzag slice of ``mb`` (``attention.cp_split``) with the tokens' original
  positions, scores the response tokens whose logits it holds and all-gathers the log-probs
  (and entropy) over the CP group, so every CP rank returns the whole micro-batch's
  ``TriLogprobs`` and computes the same loss; the gather's backward keeps each rank's own rows.
  Replayed routes (``mb.routed_experts [T, L, K]``) are sliced to the rank's tokens likewise.
- Backward: the schedule backpropagates the received gradient of the concatenated output;
  the frozen slices were produced without a graph, so their gradient (zeros in the slice
  sent back by the next stage) reaches nothing, and only policy parameters get gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from megatron_rl.attention.context import packed_attention
from megatron_rl.attention.context_parallel import gather_rows
from megatron_rl.attention.cp_split import CPScoring, CPSlice, cp_scoring_of, cp_slice_of
from megatron_rl.attention.packing import PackedMicroBatch
from megatron_rl.config.schema import AlgorithmConfig, TrainerConfig
from megatron_rl.trimodel.logprobs import head_logprobs, hidden_states_only


@dataclass(frozen=True, kw_only=True)
class LogprobSettings:
    """How the tri-model turns each copy's hidden states into per-token log-probs; built once at
    the composition root (``trainer.build``) and passed down unchanged. Defaults are the schema's."""

    vocab_size: int  # the model's unpadded vocabulary: logit columns at ids >= it (megatron's padding) are masked off
    temperature: float = AlgorithmConfig.temperature  # log-probs at the sampling temperature
    with_entropy: bool = AlgorithmConfig.entropy_coef > 0  # the policy's per-token entropy too (for the bonus)
    logprob_chunk_tokens: int = TrainerConfig.logprob_chunk_tokens  # head rows scored at a time
    # algorithm.routing_replay 'rollout': policy and old take mb.routed_experts (trimodel/routing.py)
    routing_replay: bool = AlgorithmConfig.routing_replay == "rollout"


@dataclass(frozen=True, kw_only=True)
class TriLogprobs:
    """Per-token log-probs of one packed micro-batch's N response tokens (``mb.target_ids`` order)."""

    policy: torch.Tensor  # [N] fp32, with grad
    old: torch.Tensor  # [N] fp32, no grad; the detached policy log-probs when old is skipped
    ref: torch.Tensor | None  # [N] fp32, no grad; None when the reference is skipped
    entropy: torch.Tensor | None  # [N] fp32 policy entropy (with grad), when requested
    old_is_policy: bool  # True when ``old`` is the detached policy (old skipped)


Switch = Callable[[], contextlib.AbstractContextManager]  # a copy's context around its forward


@dataclass(frozen=True, eq=False)
class Stream:
    """One hidden stream of the stage: the copy it scores (``policy``, ``old`` or ``ref``), the
    module that computes it and the context it runs under (LoRA: adapters off / snapshot in)."""

    name: str
    module: torch.nn.Module
    switch: Switch = contextlib.nullcontext

    @property
    def frozen(self) -> bool:
        """Scored without grad (every copy but the policy)."""
        return self.name != "policy"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The innermost module of a wrapper chain (megatron DDP, Float16Module) via ``.module``."""
    while hasattr(model, "module"):
        model = model.module
    return model


class TriStage(torch.nn.Module):
    """This rank's PP stage of policy + old + ref (see the module docstring for the contract)."""

    def __init__(
        self,
        *,
        policy: torch.nn.Module,
        old: torch.nn.Module | None,
        ref: torch.nn.Module | None,
        logprobs: LogprobSettings,
        shared: Mapping[str, Switch] | None = None,
    ) -> None:
        """``shared``: copies (``old`` / ``ref``, given as None) computed by the policy's own
        module under the given switch (LoRA)."""
        super().__init__()
        self.policy, self.old, self.ref = policy, old, ref
        self.logprobs = logprobs
        shared = dict(shared or {})
        self._streams = [Stream("policy", policy)]
        for name, module in (("old", old), ("ref", ref)):
            if module is not None and name in shared:
                raise ValueError(f"{name} is given as a module and as shared with the policy")
            if module is not None:
                self._streams.append(Stream(name, module))
            elif name in shared:
                self._streams.append(Stream(name, policy, shared[name]))
        self._inputs: list[torch.Tensor | None] = [None] * len(self._streams)
        inner = unwrap(policy)
        self.config = inner.config  # megatron's schedule reads it via get_model_config
        self.model_type = inner.model_type
        self.post_process = inner.post_process

    @property
    def routing_replay(self) -> bool:
        """Whether policy and old replay the engine's routes (``LogprobSettings.routing_replay``)."""
        return self.logprobs.routing_replay

    def streams(self) -> list[Stream]:
        """The active copies' streams in order: policy, old, ref."""
        return list(self._streams)

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None] | torch.Tensor | None) -> None:
        """Split the received ``[s, n·b, h]`` activation into the n streams' inputs (kept until
        each stream's forward)."""
        (x,) = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        n = len(self._streams)
        assert x is None or x.shape[1] % n == 0, f"received {tuple(x.shape)} for {n} streams"
        chunks = [None] * n if x is None else x.chunk(n, dim=1)
        self._inputs = [
            None if chunk is None else chunk.detach() if stream.frozen else chunk.contiguous()
            for stream, chunk in zip(self._streams, chunks, strict=True)
        ]

    def forward(self, mb: PackedMicroBatch) -> torch.Tensor | TriLogprobs:
        """Hidden ``[T, n, h]`` on a non-last stage; ``TriLogprobs`` of ``mb`` on the last."""
        device = next(unwrap(self.policy).parameters()).device
        cp = _cp_slice(mb)
        ids, pos, index, targets, scoring = _stage_inputs(mb, cp, device)
        outs = {}
        with packed_attention(mb.layout, cp):
            for stream, chunk in zip(self._streams, self._inputs, strict=True):
                module = stream.module
                unwrap(module).set_input_tensor([chunk])  # right before its forward: a module may be shared
                grad = torch.no_grad() if stream.frozen else contextlib.nullcontext()
                with grad, stream.switch(), self._routes(stream, mb, device):
                    if not self.post_process:
                        outs[stream.name] = module(ids, pos, attention_mask=None)
                        continue
                    with hidden_states_only(unwrap(module)):
                        hidden = module(ids, pos, attention_mask=None)  # [T, 1, h]
                    outs[stream.name] = _gathered(
                        self._reduce(module, hidden[index, 0], targets, stream.frozen), cp, scoring
                    )
        if not self.post_process:
            return torch.cat(list(outs.values()), dim=1)
        policy_lp, policy_ent = outs["policy"]
        old = outs["old"][0] if "old" in outs else policy_lp.detach()
        ref = outs["ref"][0] if "ref" in outs else None
        return TriLogprobs(policy=policy_lp, old=old, ref=ref, entropy=policy_ent, old_is_policy="old" not in outs)

    def _routes(self, stream: Stream, mb: PackedMicroBatch, device: torch.device):
        """The engine's routes forced on the stream module's routers for its forward (policy and
        old replay, the reference routes itself: ``trimodel/routing.py`` says why)."""
        if not self.routing_replay or stream.name == "ref":
            return contextlib.nullcontext()
        if mb.routed_experts is None:
            raise ValueError("algorithm.routing_replay is 'rollout' but a micro-batch carries no routed experts")
        from megatron_rl.trimodel.routing import replaying

        routes, cp = mb.routed_experts.to(device), _cp_slice(mb)
        if cp is not None:  # [T, L, K] -> this CP rank's tokens [T_r, L, K], sliced as the tokens are
            routes = routes[cp.local_index.to(device)]
        return replaying(unwrap(stream.module), routes, backward=stream.name == "policy")

    def _reduce(self, module: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, frozen: bool):
        """Hidden states ``[N, h]`` of the scored positions -> (log-probs [N], entropy [N] or None)."""
        s = self.logprobs
        return head_logprobs(
            unwrap(module),
            hidden,
            targets,
            vocab_size=s.vocab_size,
            temperature=s.temperature,
            with_entropy=s.with_entropy and not frozen,
            chunk_tokens=s.logprob_chunk_tokens,
        )


def _cp_slice(mb: PackedMicroBatch) -> CPSlice | None:
    """This rank's context-parallel slice of ``mb``, None at CP 1."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    return None if cp == 1 else cp_slice_of(mb.layout, cp, ps.get_context_parallel_rank())


def _stage_inputs(mb: PackedMicroBatch, cp: CPSlice | None, device: torch.device):
    """(ids [1, T_r], positions [1, T_r], scored rows [N_r], targets [N_r], CP scoring or None):
    the whole micro-batch at CP 1, this CP rank's slice of it otherwise."""
    ids, pos = mb.token_ids.to(device), mb.position_ids.to(device)
    index, targets = mb.logit_index.to(device), mb.target_ids.to(device)
    if cp is None:
        return ids[None], pos[None], index, targets, None
    scoring = cp_scoring_of(cp, mb.layout, mb.logit_index)
    local = cp.local_index.to(device)
    mine = scoring.items.index[cp.rank].to(device)
    return ids[local][None], pos[local][None], scoring.local_rows.to(device), targets[mine], scoring


def _gathered(pair, cp: CPSlice | None, scoring: CPScoring | None):
    """(log-probs, entropy) of this CP rank's scored tokens -> of all N (CP group all-gather)."""
    if cp is None:
        return pair
    from megatron.core import parallel_state as ps

    group = ps.get_context_parallel_group()
    return tuple(
        None if x is None else gather_rows(x, scoring.items, rank=cp.rank, group=group, sum_grads=False) for x in pair
    )
