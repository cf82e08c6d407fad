"""One pipeline stage of the tri-model: three copies that megatron's schedule sees as one model.

``TriStage`` wraps this rank's stage of the policy (trainable, possibly DDP-wrapped) and of
the active frozen copies (old, ref). Contract with megatron-core 0.16's schedules:

- ``set_input_tensor([x])`` gets the activation received from the previous stage, the
  hidden streams of the active copies side by side on the batch dim: ``[s, n·b, h]``
  (``[T, n, h]`` for one packed micro-batch, n = 1..3, policy first). It is split into n
  chunks, one per copy's ``set_input_tensor``.
- ``forward(mb)`` runs the policy with grad and the frozen copies under ``no_grad`` on the
  packed micro-batch ``mb``. A non-last stage returns ``torch.cat(hidden, dim=1)`` (the
  tensor sent on); the last stage returns ``TriLogprobs`` (each copy's logits are reduced to
  per-token log-probs right away, so at most one copy's ``[T, V/tp]`` logits live at a time).
- Backward: the schedule backpropagates the received gradient of the concatenated output;
  the frozen slices were produced without a graph, so their gradient (zeros in the slice
  sent back by the next stage) reaches nothing, and only policy parameters get gradients.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megatron_rl.attention.context import packed_attention
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
    ) -> None:
        super().__init__()
        self.policy, self.old, self.ref = policy, old, ref
        self.logprobs = logprobs
        inner = unwrap(policy)
        self.config = inner.config  # megatron's schedule reads it via get_model_config
        self.model_type = inner.model_type
        self.post_process = inner.post_process

    @property
    def routing_replay(self) -> bool:
        """Whether policy and old replay the engine's routes (``LogprobSettings.routing_replay``)."""
        return self.logprobs.routing_replay

    def streams(self) -> list[tuple[torch.nn.Module, bool]]:
        """(module, frozen) of the active copies in stream order: policy, old, ref."""
        return [(self.policy, False)] + [(m, True) for m in (self.old, self.ref) if m is not None]

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None] | torch.Tensor | None) -> None:
        """Split the received ``[s, n·b, h]`` activation into the n copies' inputs."""
        (x,) = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        streams = self.streams()
        assert x is None or x.shape[1] % len(streams) == 0, f"received {tuple(x.shape)} for {len(streams)} streams"
        chunks = [None] * len(streams) if x is None else x.chunk(len(streams), dim=1)
        for (module, frozen), chunk in zip(streams, chunks, strict=True):
            if chunk is not None:
                chunk = chunk.detach() if frozen else chunk.contiguous()
            unwrap(module).set_input_tensor([chunk])

    def forward(self, mb: PackedMicroBatch) -> torch.Tensor | TriLogprobs:
        """Hidden ``[T, n, h]`` on a non-last stage; ``TriLogprobs`` of ``mb`` on the last."""
        device = next(unwrap(self.policy).parameters()).device
        ids, pos = mb.token_ids.to(device)[None], mb.position_ids.to(device)[None]
        index, targets = mb.logit_index.to(device), mb.target_ids.to(device)
        outs = []
        with packed_attention(mb.layout):
            for module, frozen in self.streams():
                with torch.no_grad() if frozen else contextlib.nullcontext(), self._routes(module, mb, device):
                    if not self.post_process:
                        outs.append(module(ids, pos, attention_mask=None))
                        continue
                    with hidden_states_only(unwrap(module)):
                        hidden = module(ids, pos, attention_mask=None)  # [T, 1, h]
                    outs.append(self._reduce(module, hidden[index, 0], targets, frozen))
        if not self.post_process:
            return torch.cat(outs, dim=1)
        policy_lp, policy_ent = outs[0]
        old = outs[1][0] if self.old is not None else policy_lp.detach()
        ref = outs[-1][0] if self.ref is not None else None
        return TriLogprobs(policy=policy_lp, old=old, ref=ref, entropy=policy_ent, old_is_policy=self.old is None)

    def _routes(self, module: torch.nn.Module, mb: PackedMicroBatch, device: torch.device):
        """The engine's routes forced on ``module``'s routers for its forward (policy and old
        replay, the reference routes itself: ``trimodel/routing.py`` says why)."""
        if not self.routing_replay or module is self.ref:
            return contextlib.nullcontext()
        if mb.routed_experts is None:
            raise ValueError("algorithm.routing_replay is 'rollout' but a micro-batch carries no routed experts")
        from megatron_rl.trimodel.routing import replaying

        return replaying(unwrap(module), mb.routed_experts.to(device), backward=module is self.policy)

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
