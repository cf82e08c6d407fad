"""The tri-model: policy, old policy and reference in one sharding, one schedule per micro-step.

``TriModel`` owns this rank's stage of the three copies (built identically, same TP/PP
sharding) and the ``TriModelPlan`` saying where each lives. ``run(micro_batches, loss=…)``
is one micro-step: ONE megatron pipeline schedule over the packed micro-batches, the three
hidden streams travelling together between stages (``TriStage``), yielding per micro-batch a
``TriLogprobs`` (policy with grad, old / ref without) that the loss callback turns into
``(loss, payload)``. Offloaded copies are put on the device for the micro-step and back on
host memory after it. ``refresh_old()`` snapshots the policy into the old copy: call it at
the start of every iteration (before the batch's first forward). With a LoRA plan
(``plan.lora``) no copy is built: ref is the policy's module with adapters off, old the same
module with an adapter snapshot (``lora.switch``) swapped in, the snapshot being all old costs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_rl.attention.packing import PackedMicroBatch
from megatron_rl.lora.switch import adapters_from, adapters_off, refresh_snapshot, snapshot_adapters
from megatron_rl.parallel.schedule import run_schedule
from megatron_rl.platform.patches.finalize_grads import scoped_finalize_model_grads
from megatron_rl.trimodel.offload import HostOffload
from megatron_rl.trimodel.plan import CopyPlan, Residency, TriModelPlan
from megatron_rl.trimodel.stage import LogprobSettings, TriLogprobs, TriStage, unwrap

LossFn = Callable[[TriLogprobs, int], tuple[torch.Tensor, Any]]


@dataclass(frozen=True, kw_only=True)
class CopyMemory:
    """Parameter bytes of one copy on this rank, by where they rest between micro-steps."""

    residency: Residency
    device_bytes: int
    host_bytes: int


@dataclass(frozen=True, kw_only=True)
class TriModelMemory:
    """Per-copy parameter memory of this rank's stage, plus cumulative host -> device traffic."""

    policy: CopyMemory
    old: CopyMemory
    ref: CopyMemory
    bytes_onloaded: int

    def as_metrics(self, prefix: str = "trimodel/") -> dict[str, float]:
        """Flat metrics: ``{prefix}{copy}_device_bytes``, ``…_host_bytes``, ``{prefix}bytes_onloaded``."""
        out = {f"{prefix}bytes_onloaded": float(self.bytes_onloaded)}
        for name in ("policy", "old", "ref"):
            mem = getattr(self, name)
            out[f"{prefix}{name}_device_bytes"] = float(mem.device_bytes)
            out[f"{prefix}{name}_host_bytes"] = float(mem.host_bytes)
        return out


def _param_bytes(module: torch.nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() * p.element_size() for p in module.parameters())


def _check_copy(name: str, module: torch.nn.Module | None, plan: CopyPlan) -> None:
    if plan.residency is Residency.SHARED and module is not None:
        raise ValueError(f"{name} is computed on the policy's module ({plan.reason}); pass {name}=None")
    if plan.residency is Residency.SHARED:
        return
    if plan.active and module is None:
        raise ValueError(f"{name}=None but the plan needs it ({plan.reason})")
    if not plan.active and module is not None:
        raise ValueError(f"{name} was given but the plan skips it ({plan.reason}); pass {name}=None")


class TriModel:
    """Policy + old + ref on this rank's stage; see the module docstring."""

    def __init__(
        self,
        *,
        policy: torch.nn.Module,
        old: torch.nn.Module | None,
        ref: torch.nn.Module | None,
        plan: TriModelPlan,
        logprobs: LogprobSettings,
    ) -> None:
        """``policy``: the GPTModel stage or a wrapper whose ``.module`` chain ends in it (DDP).
        ``old`` / ``ref``: GPTModel stages built like the policy, or None where ``plan`` skips them.
        ``logprobs``: how the stage scores tokens; with ``routing_replay``, policy and old take each
        micro-batch's engine routes (``trimodel/routing.py``)."""
        _check_copy("old", old, plan.old)
        _check_copy("ref", ref, plan.ref)
        self.plan = plan
        self.policy, self.old, self.ref = policy, old, ref
        device = next(unwrap(policy).parameters()).device
        self._offload: dict[str, HostOffload] = {}
        for name, module, copy_plan in (("old", old, plan.old), ("ref", ref, plan.ref)):
            if module is None:
                continue
            module.requires_grad_(False)
            module.eval()
            if copy_plan.residency is Residency.OFFLOADED:
                self._offload[name] = HostOffload(module, device=device)
        if logprobs.routing_replay and plan.lora:
            raise ValueError("algorithm.routing_replay 'rollout' with LoRA is not supported (lora.rank > 0)")
        if logprobs.routing_replay:
            _attach_replay(policy, old)
        self._snapshot = snapshot_adapters(unwrap(policy)) if plan.old.residency is Residency.SHARED else None
        self.stage = TriStage(policy=policy, old=old, ref=ref, logprobs=logprobs, shared=self._shared_switches())

    def run(
        self,
        micro_batches: Sequence[PackedMicroBatch],
        *,
        loss: LossFn,
        forward_only: bool = False,
        finalize_grads: bool = True,
    ) -> list[Any]:
        """One micro-step: one schedule over ``micro_batches``, backward unless ``forward_only``.

        ``loss(logprobs, i)`` is called on the last PP stage for micro-batch ``i`` (in order)
        and returns ``(loss_i, payload_i)``; the losses are summed (see ``run_schedule``).
        Returns the payloads on the last stage, ``[]`` elsewhere. ``finalize_grads=False`` skips
        megatron's ``finalize_model_grads`` (DP reduction, tied-embedding sum): a trainer that
        accumulates several micro-steps calls it once, after the last (summing twice is wrong).
        """
        if not micro_batches:
            raise ValueError("micro_batches is empty")
        items = list(enumerate(micro_batches))
        with self._onloaded(), self._finalize_on_policy(finalize_grads), self._routes_cleared():
            return run_schedule(
                self.stage,
                items,
                forward_step=lambda stage, item: stage(item[1]),
                loss=lambda out, item: loss(out, item[0]),
                seq_length=lambda item: item[1].num_tokens,
                forward_only=forward_only,
            )

    def _shared_switches(self) -> dict:
        """The switches of the copies run on the policy's module (LoRA plans)."""
        inner, shared = unwrap(self.policy), {}
        if self.plan.ref.residency is Residency.SHARED:
            shared["ref"] = lambda: adapters_off(inner)
        if self._snapshot is not None:
            shared["old"] = lambda: adapters_from(inner, self._snapshot)
        return shared

    @torch.no_grad()
    def refresh_old(self) -> bool:
        """Copy the policy's parameters into the old copy (iteration start), with LoRA its adapters
        into the snapshot; False when old is skipped."""
        if self._snapshot is not None:
            refresh_snapshot(self._snapshot, unwrap(self.policy))
            return True
        if self.old is None:
            return False
        pairs = zip(unwrap(self.policy).named_parameters(), self.old.named_parameters(), strict=True)
        for (name, p), (old_name, q) in pairs:
            assert name == old_name, f"policy/old parameter order differs: {name} vs {old_name}"
            q.copy_(p)  # lands in host memory when old is offloaded (released between micro-steps)
        return True

    def memory_report(self) -> TriModelMemory:
        """Parameter bytes per copy on this rank, by residency (for the metrics)."""

        def copy(module: torch.nn.Module | None, residency: Residency, shared_bytes: int = 0) -> CopyMemory:
            n = shared_bytes if residency is Residency.SHARED else _param_bytes(module)
            on_host = residency is Residency.OFFLOADED
            return CopyMemory(residency=residency, device_bytes=0 if on_host else n, host_bytes=n if on_host else 0)

        snapshot = self._snapshot.nbytes if self._snapshot is not None else 0  # LoRA: all old holds
        return TriModelMemory(
            policy=copy(unwrap(self.policy), Residency.RESIDENT),
            old=copy(self.old, self.plan.old.residency, snapshot),
            ref=copy(self.ref, self.plan.ref.residency),  # LoRA: 0, the policy's base with adapters off
            bytes_onloaded=sum(o.bytes_onloaded for o in self._offload.values()),
        )

    @contextlib.contextmanager
    def _onloaded(self) -> Iterator[None]:
        """Offloaded copies on the device for the duration of one micro-step."""
        try:
            for offload in self._offload.values():
                offload.onload()
            yield
        finally:
            for offload in self._offload.values():
                offload.release()

    @contextlib.contextmanager
    def _routes_cleared(self) -> Iterator[None]:
        """Replayed routes queued for recompute are dropped when the schedule ends."""
        try:
            yield
        finally:
            if self.stage.routing_replay:
                from megatron_rl.trimodel.routing import clear

                for stream in self.stage.streams():
                    clear(stream.module)

    def _finalize_on_policy(self, enabled: bool):
        """Megatron's ``finalize_model_grads`` scoped to the policy chunk for one schedule
        (``platform/patches/finalize_grads``), or switched off for it (``enabled=False``)."""
        return scoped_finalize_model_grads(self.stage.config, self.policy, enabled=enabled)


def _attach_replay(policy: torch.nn.Module, old: torch.nn.Module | None) -> None:
    """Routers of the replaying copies get a ``RouterReplay``; a dense model is refused."""
    from megatron_rl.trimodel.routing import attach_replay, moe_layer_numbers

    config = unwrap(policy).config
    if not config.num_moe_experts or not moe_layer_numbers(config):
        raise ValueError("algorithm.routing_replay is 'rollout' but the policy has no MoE layers; set it to 'none'")
    for module in (policy, old):
        if module is not None:
            attach_replay(module)


def load_frozen_copies(
    plan: TriModelPlan, *, policy_path: str | Path, ref_path: str | Path | None = None, **build: Any
) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """Build and load the (old, ref) stages the plan needs; None where it skips them.

    old starts from ``policy_path`` (θ_0), ref from ``ref_path`` (default: ``policy_path``);
    ``build`` goes to ``load_model_from_hf`` (``params_dtype``, ``attention_backend``, …).
    """
    from megatron_rl.models import load_model_from_hf

    if plan.lora:
        return None, None  # old and ref run on the policy's module
    old = load_model_from_hf(policy_path, **build)[0] if plan.old.active else None
    ref = load_model_from_hf(ref_path or policy_path, **build)[0] if plan.ref.active else None
    return old, ref
