"""The weight of megatron-core's MoE router losses (load-balancing aux loss, z-loss) in a
training step: a scoped patch of ``MoEAuxLossAutoScaler.set_loss_scale``.

Why. megatron attaches each sparse layer's router loss L (coefficient included) to the forward
graph with ``MoEAuxLossAutoScaler``, whose backward adds ``scale · ∇L``; the schedule sets
``scale`` in ``forward_step_calc_loss`` (after the forward and the loss function, before the
backward) to ``grad_scale_func(1) · cp / num_microbatches`` = 1 here (one micro-batch per
schedule call, no ``grad_scale_func``). ``PolicyTrainer`` backpropagates every micro-batch's
loss *numerator* and scales the accumulated gradient by 1 / D once (D = the RL loss
denominator, summed over the step's micro-batches and DP ranks, known only at the end), so at
scale 1 the router losses entered the objective as Σ_m L_m / D: ~M / D times their mean.

The fix: micro-batch m's router losses are scaled by d_m, its own share of D, so the step's
objective gets Σ_m (d_m / D) · L_m: the router losses' mean over the step's micro-batches
(every DP rank's), weighted as the RL loss weights them (by response tokens for the token-mean
losses, by sequences for grpo / dr_grpo). It is coeff · L for a single micro-batch, does not
depend on DP size or on D's magnitude, and is the plain mean when the micro-batches carry
equal denominators. (The unweighted mean would need D and the micro-batch count at each
backward, which a batch whose groups arrive over time does not know.) Inside
``router_loss_weight`` the scale megatron sets is multiplied by d_m; every PP stage's routers
read it in their backward (recompute included). Tested by ``tests/test_moe_training.py``.

Versions: megatron-core 0.16.x (``pipeline_parallel/schedules.py`` calls
``MoEAuxLossAutoScaler.set_loss_scale`` once per micro-batch forward, on every stage; the
class is ``transformer/moe/moe_utils.py``'s). Delete when megatron lets the caller give each
micro-batch's aux-loss scale (or its loss function returns one the schedule passes on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def router_loss_weight(weight: torch.Tensor) -> Iterator[None]:
    """Inside: the MoE router losses' gradient scale megatron sets is multiplied by ``weight``
    (a 0-dim device tensor; no host sync)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    original = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]

    def weighted(scale: torch.Tensor) -> None:
        original.__func__(scale * weight.to(device=scale.device, dtype=scale.dtype))

    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(weighted)
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = original
