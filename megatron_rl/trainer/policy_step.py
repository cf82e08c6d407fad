"""Train the policy on scored groups as they arrive; one optimizer step per mini-batch.

``PolicyTrainer`` is the trainer side of the pipeline (``megatron_rl.pipeline``):
``train_micro_batch`` runs a tri-model micro-step on one packed ``MicroBatch`` (forward +
backward, gradients accumulate); ``finish_mini_batch`` performs the optimizer step.

Loss normalisation (DESIGN §5): groups arrive over time, so the batch's denominator (token
or sequence count) is unknown at the first backward. Every micro-batch therefore
backpropagates its loss *numerator* (denominator 1), and the accumulated gradient is scaled
by 1 / D once, before the optimizer step, with D summed over all micro-batches and DP
ranks. Gradients are linear in the loss, so this equals the gradient of the whole batch's
normalised loss however the batch was split or ordered. An MoE policy's router losses, which
megatron adds inside backward, are weighted by the micro-batch's own share of D
(``platform/patches/moe_aux_loss_scale``), so they enter the step as their denominator-weighted mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.algorithms import LossMetrics, LossSettings, loss_denominator, policy_loss
from megatron_rl.attention.packing import pad_responses, response_mask
from megatron_rl.pipeline.records import MicroBatch
from megatron_rl.platform.patches.moe_aux_loss_scale import router_loss_weight
from megatron_rl.trainer.mismatch_gate import check_mismatch
from megatron_rl.trainer.world_metrics import counts_loss, world_merged
from megatron_rl.trimodel import TriLogprobs, TriModel


@dataclass(frozen=True, kw_only=True)
class MiniBatchResult:
    """What one optimizer step reports."""

    grad_norm: float
    denominator: float
    loss: float  # the mini-batch's normalised loss
    loss_metrics: LossMetrics | None = None  # the world's sums and maxima (host tensors); None if skipped
    skipped: bool = False  # no optimizer step was taken (no trainable token, or non-finite)
    nonfinite: bool = False  # skipped because the loss or a gradient was NaN / inf on some rank


class PolicyTrainer:
    """Tri-model micro-steps with deferred normalisation, then megatron's optimizer step."""

    def __init__(self, *, trimodel: TriModel, ddp, optimizer, loss: LossSettings, shared_prompt: bool = True) -> None:
        self.trimodel, self.ddp, self.optimizer, self.loss = trimodel, ddp, optimizer, loss
        # attention.shared_prompt: false packs K prompt copies; rank 0 converts each micro-batch before
        # it is trained or sent (replica.LeaderReplica: the groups it needs stay there), not here.
        self.shared_prompt = shared_prompt
        self.device = next(ddp.parameters()).device  # the compute device every micro-step runs on
        self._reset()

    def _reset(self) -> None:
        # Device scalars: a micro-step adds to them without a host sync; read once per step. The
        # denominator is a count (int64: exact past fp32's 2^24), the numerator a float sum (fp32:
        # a 910B computes no fp64 and HCCL all-reduces neither).
        self._numerator = torch.zeros((), dtype=torch.float32, device=self.device)
        self._denominator = torch.zeros((), dtype=torch.int64, device=self.device)
        self._metrics: LossMetrics | None = None
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def begin_batch(self) -> None:
        """Iteration start: snapshot the policy into the old copy (when the plan keeps one)."""
        self.trimodel.refresh_old()

    def train_micro_batch(self, mb: MicroBatch) -> None:
        """Forward + backward of one packed micro-batch; gradients accumulate until the step."""
        mb = mb.to(self.device)  # once per micro-batch: the loss meets only device tensors
        mask = self._counted(mb)
        share = loss_denominator(self.loss, mask)  # this micro-batch's share of D, on every PP stage
        with router_loss_weight(share):  # MoE router losses weighted by it (moe_aux_loss_scale)
            self.trimodel.run(
                [mb.packed], loss=lambda lp, _i: self._micro_loss(lp, mb, mask, share), finalize_grads=False
            )

    def _counted(self, mb: MicroBatch) -> torch.Tensor:
        """``[R, max_len]`` bool: the response tokens that carry a loss term."""
        packed = mb.packed
        mask = response_mask(packed, max(packed.response_lens), self.device)
        if mb.loss_mask is not None:  # multi-turn: observation tokens carry no loss term at all
            mask = mask & pad_responses(mb.loss_mask, packed, pad_value=False)
        return mask

    def _micro_loss(self, lp: TriLogprobs, mb: MicroBatch, mask: torch.Tensor, share: torch.Tensor):
        packed = mb.packed
        logp = pad_responses(lp.policy, packed)
        # One optimizer step per batch: every forward of the batch runs at θ_t, so the old policy
        # (and the recompute proximal of ppo_decoupled) is the detached policy, no extra forward.
        old = logp.detach() if lp.old_is_policy else pad_responses(lp.old, packed)
        ref = pad_responses(lp.ref, packed) if lp.ref is not None else None
        entropy = pad_responses(lp.entropy, packed) if lp.entropy is not None else None
        behav = pad_responses(mb.behav_logprobs.to(logp.dtype), packed)
        teacher = None if mb.teacher_logprobs is None else pad_responses(mb.teacher_logprobs.to(logp.dtype), packed)
        out = policy_loss(
            self.loss,
            logp=logp,
            mask=mask,
            advantages=mb.advantages.to(logp.dtype),
            denominator=1.0,
            old_logp=old,
            ref_logp=ref,
            behav_logp=behav,
            # the engine is compared with θ_t: the old copy, or the policy before the first step
            compare_engine=not lp.old_is_policy or mb.mini_batch == 0,
            versions=pad_responses(mb.token_versions, packed, pad_value=mb.policy_version),  # each token's own
            current_version=mb.policy_version,
            entropy=entropy,
            teacher_logp=teacher,  # on-policy distillation (algorithms.distill)
        )
        self._numerator += out.loss.detach().float()
        self._denominator += share
        self._metrics = out.metrics if self._metrics is None else self._metrics.merge(out.metrics)
        return out.loss, None

    def finish_mini_batch(self) -> MiniBatchResult:
        """Scale grads by 1/D (D summed over micro-batches and ranks), reduce over DP, step."""
        from megatron.core.distributed import finalize_model_grads

        denominator, numerator = self._global_totals()
        if denominator <= 0:  # every group of the mini-batch dropped (dynamic sampling): nothing to learn
            self._reset()
            return MiniBatchResult(grad_norm=0.0, denominator=0.0, loss=0.0, skipped=True)
        from megatron.core import parallel_state as ps

        world = world_merged(self._metrics, counts=counts_loss())  # the same world values on every rank
        # algorithm.mismatch_alarm: one verdict on every rank; action "stop" raises before the step.
        check_mismatch(self.loss.mismatch_alarm, world.mismatch if world is not None else None)
        # megatron's DDP averages over DP ranks (scales by 1/dp before its reduce-sum); the batch
        # gradient is the plain sum of the ranks' numerator gradients, hence dp / D.
        self.ddp.scale_gradients(ps.get_data_parallel_world_size() / denominator)
        finalize_model_grads([self.ddp])
        ok, grad_norm = False, None
        if self._finite_everywhere():  # same verdict on every rank: all skip together
            ok, grad_norm, _ = self.optimizer.step()  # not ok: megatron's own check (fp16 loss scaling)
        if not ok:  # nothing was applied
            self._reset()
            return MiniBatchResult(
                grad_norm=float("nan"), denominator=denominator, loss=float("nan"), skipped=True, nonfinite=True
            )
        result = MiniBatchResult(
            grad_norm=float(grad_norm or 0.0), denominator=denominator, loss=numerator / denominator, loss_metrics=world
        )
        self._reset()
        return result

    def _finite_everywhere(self) -> bool:
        """True iff the loss and every gradient of every rank are finite: the verdict is formed on
        the device, all-reduced there (MIN) and read once."""
        flag = torch.isfinite(self._numerator)
        for buf in self.ddp.buffers + self.ddp.expert_parallel_buffers:
            flag = flag & _all_finite(buf.grad_data)
        flag = flag.to(torch.int32).reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _global_totals(self) -> tuple[float, float]:
        """(denominator, numerator) summed over the model replicas' last stages (once per replica),
        reduced on the device in types HCCL's all-reduce takes (an int64 count, an fp32 sum; not
        fp64) and read once each; Python floats (the host's float64) only after the reduction."""
        totals = [self._denominator.clone(), self._numerator.clone()]
        if not counts_loss():
            totals = [torch.zeros_like(t) for t in totals]
        if dist.is_initialized() and dist.get_world_size() > 1:
            for t in totals:
                dist.all_reduce(t)
        return float(totals[0].item()), float(totals[1].item())


def _all_finite(values: torch.Tensor) -> torch.Tensor:
    """0-dim bool on ``values``' device, True iff every element is finite: min and max propagate
    NaN and hold any ±inf, and one reduction pass costs ~1/20 of ``isfinite(x).all()``."""
    if values.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=values.device)
    low, high = torch.aminmax(values)
    return torch.isfinite(low) & torch.isfinite(high)
