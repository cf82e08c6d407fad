"""megatron-core's MoE router losses under this project's context parallelism: exact token counts.

Why. Under CP each rank routes its own slice of a micro-batch, and megatron's router computes
its part of the load-balancing loss (aux_loss, seq_aux_loss) and of the z-loss so that the
parts, scaled by the CP size in the schedule (``set_loss_scale(scale · cp / M)``) and averaged
over DP × CP by DDP, add up to the loss of the whole micro-batch: the aux loss's part is
``E·c / (k·T²) · Σ_e N_e · Σ_{t local} p_te`` (N_e: the expert's tokens summed over the TP × CP
group, T: the whole micro-batch's tokens), the z-loss's ``c / |group| · mean_local(lse²)``.
megatron takes T = local tokens × |group| and the z-loss's mean per rank, exact when every
rank holds as many tokens as the others (megatron's own CP pads every sequence to 2·cp equal
chunks). This project's per-segment zigzag (``attention/cp_split``) does not pad: ranks differ
by up to one token per segment, and both router losses drifted from CP 1's.

The fix (only while megatron's CP size is > 1; CP 1 runs megatron's code unchanged):
- the aux losses' token counts: ``get_tokens_per_expert_and_token_count`` takes its
  ``with_padding_mask`` branch, which counts T exactly (Σ_e N_e / k over the group: every token
  is counted k times in the top-k map the aux loss reads) and the local count likewise;
- the z-loss: megatron's local mean times ``n_local · |group| / T`` (T all-reduced over the TP × CP
  group, one scalar per sparse layer and forward), so rank r contributes
  ``c / |group| · |group| · Σ_{t local} lse² / T`` and the ranks' parts sum to ``c · mean(lse²)``.
Tested by ``tests/test_context_parallel_moe.py`` (CP 2 × EP 2 gradients equal CP 1's, router
losses on, with ragged segments).

Versions: megatron-core 0.16.x (``router.py`` imports both functions by name from ``moe_utils``;
``Router._apply_aux_loss`` / ``_apply_seq_aux_loss`` / ``apply_z_loss`` call them with
``reduce_group`` = ``pg_collection.tp_cp``). Delete when megatron counts a CP group's tokens
instead of assuming equal slices.
"""

from __future__ import annotations

import torch

_ORIGINAL: dict[str, object] = {}


def _cp_active() -> bool:
    from megatron.core import parallel_state as ps

    return ps.model_parallel_is_initialized() and ps.get_context_parallel_world_size() > 1


def _token_counts(routing_map, reduce_group, topk=None, with_padding_mask=False):
    """``get_tokens_per_expert_and_token_count`` counting the group's tokens exactly under CP."""
    exact = with_padding_mask or _cp_active()
    return _ORIGINAL["counts"](routing_map=routing_map, reduce_group=reduce_group, topk=topk, with_padding_mask=exact)


def _z_loss(logits: torch.Tensor, z_loss_coeff: float, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``z_loss_func`` whose local mean is re-weighted by this rank's share of the group's tokens under CP."""
    z = _ORIGINAL["z_loss"](logits, z_loss_coeff, padding_mask=padding_mask)
    if not _cp_active():
        return z
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_and_context_parallel_group()
    with torch.no_grad():
        local = (~padding_mask).sum() if padding_mask is not None else torch.tensor(logits.shape[0])
        local = local.to(device=logits.device, dtype=torch.float32)
        total = local.clone()
        torch.distributed.all_reduce(total, group=group)
        factor = local * torch.distributed.get_world_size(group) / total.clamp_min(1.0)
    # a rank holding no token (a micro-batch shorter than 2·cp per segment) adds nothing
    return torch.where(local > 0, z * factor.to(z.dtype), torch.zeros_like(z))


def apply() -> None:
    """Patch ``router``'s two names as the module doc says (idempotent)."""
    from megatron.core.transformer.moe import moe_utils, router

    if "counts" in _ORIGINAL:
        return
    _ORIGINAL["counts"] = moe_utils.get_tokens_per_expert_and_token_count
    _ORIGINAL["z_loss"] = moe_utils.z_loss_func
    router.get_tokens_per_expert_and_token_count = _token_counts
    router.z_loss_func = _z_loss
