"""Where each copy of the tri-model lives, and why (STYLE rule 8: nothing implicit).

The policy is always resident and trainable. The old policy (θ at the iteration's start)
and the reference are each ``resident`` (device memory), ``offloaded`` (host memory between
micro-steps, moved to the device for each one) or ``skipped`` (not built, not run):

- old is skipped when it cannot differ from the policy: a rollout batch gets exactly one
  optimizer step, so every forward of the batch sees θ_t (its log-probs are then the
  detached policy log-probs: that is also the ``recompute`` proximal of ``ppo_decoupled``,
  π_prox = θ_t, got without an extra forward), or the loss never reads it
  (``ppo_decoupled`` with the ``loglinear`` A-3PO proximal, which interpolates instead) and
  no rollout correction compares the engine with θ_t after the batch's first optimizer step
  (a correction mode other than ``none`` keeps it; without one, the engine-vs-trainer
  mismatch is measured on the first mini-batch only, where the policy still is θ_t);
- the reference is skipped when no loss term needs it (``kl_coef == 0``).

With LoRA (``lora=True``) a kept copy is ``shared``: no copy of the weights exists. The reference
is the policy's own module with its adapters off (the frozen base), the old policy the same
module with a snapshot of the adapter tensors (taken at ``refresh_old``) swapped in; only that
snapshot takes memory. Offloading has nothing to move and is refused.

``plan_trimodel`` makes that decision once, from the loss settings and the optimizer steps
per batch; the plan's ``reasons`` go to the run log.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from megatron_rl.algorithms.losses import LossSettings
from megatron_rl.config.schema import TrainerConfig

COPIES = ("policy", "old", "ref")


class Residency(enum.Enum):
    """Where a copy's parameters live between micro-steps."""

    RESIDENT = "resident"  # device memory throughout
    OFFLOADED = "offloaded"  # host memory; on the device only during a micro-step
    SKIPPED = "skipped"  # not built and not run
    SHARED = "shared"  # run on the policy's module (LoRA: ref = adapters off, old = adapter snapshot)


@dataclass(frozen=True, kw_only=True)
class CopyPlan:
    """One copy's residency and the sentence that justifies it."""

    residency: Residency
    reason: str

    @property
    def active(self) -> bool:
        return self.residency is not Residency.SKIPPED


@dataclass(frozen=True, kw_only=True)
class TriModelPlan:
    """Residency of the old policy and the reference (the policy is always resident)."""

    old: CopyPlan
    ref: CopyPlan
    lora: bool = False  # the policy carries LoRA adapters: kept copies are SHARED

    @property
    def active(self) -> tuple[str, ...]:
        """The copies that run, in stream order: ``policy`` first, then ``old``, ``ref``."""
        return ("policy",) + tuple(name for name in COPIES[1:] if getattr(self, name).active)

    @property
    def own_weights(self) -> tuple[str, ...]:
        """The copies holding weights of their own (resident or offloaded); a shared copy runs
        on the policy's weights (the old policy's adapter snapshot aside)."""
        kinds = (Residency.RESIDENT, Residency.OFFLOADED)
        return ("policy",) + tuple(name for name in COPIES[1:] if getattr(self, name).residency in kinds)

    @property
    def reasons(self) -> tuple[str, ...]:
        return ("policy resident: trainable", self.old.reason, self.ref.reason)


def _kept(name: str, offload: bool, why: str) -> CopyPlan:
    if offload:
        return CopyPlan(
            residency=Residency.OFFLOADED,
            reason=f"{name} offloaded to host between micro-steps "
            f"(trainer.offload_{'old' if name == 'old' else 'reference'}); needed: {why}",
        )
    return CopyPlan(residency=Residency.RESIDENT, reason=f"{name} resident: {why}")


def plan_trimodel(
    loss: LossSettings,
    *,
    optimizer_steps_per_batch: int,
    offload_old: bool = TrainerConfig.offload_old,
    offload_ref: bool = TrainerConfig.offload_reference,
    lora: bool = False,
) -> TriModelPlan:
    """Decide which of old / ref run and where they live (see the module docstring); ``lora``:
    the policy carries adapters, so kept copies share its module."""
    if optimizer_steps_per_batch < 1:
        raise ValueError(f"optimizer_steps_per_batch must be >= 1, got {optimizer_steps_per_batch}")
    if lora and (offload_old or offload_ref):
        key = "trainer.offload_old" if offload_old else "trainer.offload_reference"
        raise ValueError(f"{key} with LoRA: old and reference share the policy's module, nothing to offload")
    steps = optimizer_steps_per_batch
    corrects = loss.correction.mode != "none"
    if loss.kind == "ppo_decoupled" and loss.proximal == "loglinear" and not (steps > 1 and corrects):
        measured = "" if steps == 1 else "; engine mismatch measured on the first mini-batch only (policy = θ_t)"
        old = CopyPlan(
            residency=Residency.SKIPPED,
            reason=f"old skipped: proximal = loglinear (A-3PO interpolates, no old-policy forward){measured}",
        )
    elif loss.kind == "ppo_decoupled" and loss.proximal == "loglinear":
        old = _kept(
            "old",
            offload_old,
            f"rollout_correction.mode = {loss.correction.mode!r} compares the "
            f"engine with θ_t over {steps} optimizer steps per batch",
        )
    elif steps == 1:
        old = CopyPlan(
            residency=Residency.SKIPPED,
            reason="old skipped: 1 optimizer step per batch (old == policy == recompute proximal; "
            "detached policy log-probs used)",
        )
    else:
        old = _kept("old", offload_old, f"{steps} optimizer steps per batch")
    if loss.kl_coef == 0:
        ref = CopyPlan(residency=Residency.SKIPPED, reason="ref skipped: kl_coef = 0 (no loss term needs it)")
    else:
        ref = _kept("ref", offload_ref, f"kl_coef = {loss.kl_coef}")
    if lora:
        old, ref = _shared(old, "the adapter snapshot taken at the iteration start"), _shared(ref, "adapters off")
    return TriModelPlan(old=old, ref=ref, lora=lora)


def _shared(plan: CopyPlan, how: str) -> CopyPlan:
    """A kept copy of a LoRA policy: the policy's module with ``how`` (no copy of the weights)."""
    if not plan.active:
        return plan
    name, why = plan.reason.split(" ", 1)[0], plan.reason.split(": ", 1)[1]
    return CopyPlan(residency=Residency.SHARED, reason=f"{name} shared: the policy's module with {how} (LoRA); {why}")
