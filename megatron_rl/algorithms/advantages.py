"""Group-relative advantages (GRPO, Dr.GRPO) from rewards grouped by prompt.

Contract: pure tensor functions, rewards in, one advantage per response out. A group is the
G responses to one prompt; groups may be ragged (a list of 1-D tensors). The baseline is the
group mean; ``scale`` picks the spread that divides it:

- ``"group"``: the group's own std (GRPO, DeepSeekMath),
- ``"batch"``: the std of all rewards of the batch (TRL ``scale_rewards="batch"``),
- ``"none"``: no division (Dr.GRPO, Liu et al. 2025: the std term biases toward easy/hard
  prompts).

Stds are unbiased (Bessel), as in TRL. Degenerate cases are explicit, not left to ``eps``:
a group of size 1 and a group whose rewards are all equal get advantage exactly 0 (they carry
no relative signal); a batch std of 0 likewise gives zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args, overload

import torch

from megatron_rl.config.schema import AdvantageScale

ADVANTAGE_SCALES: tuple[str, ...] = get_args(AdvantageScale)


@overload
def group_advantages(rewards: torch.Tensor, *, scale: AdvantageScale = "group", eps: float = 1e-6) -> torch.Tensor: ...


@overload
def group_advantages(
    rewards: Sequence[torch.Tensor], *, scale: AdvantageScale = "group", eps: float = 1e-6
) -> list[torch.Tensor]: ...


def group_advantages(rewards, *, scale="group", eps=1e-6):
    """Advantages A_i = (r_i − mean_g) / (std + eps), or r_i − mean_g for ``scale="none"``.

    ``rewards``: ``[n_groups, G]`` tensor, or a sequence of 1-D tensors (ragged groups, one
    per prompt). Returns the same structure (``[n_groups, G]`` or a list), float32 at least.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if isinstance(rewards, torch.Tensor):
        if rewards.dim() != 2 or rewards.numel() == 0:
            raise ValueError(f"rewards must be a non-empty [n_groups, G] tensor, got shape {tuple(rewards.shape)}")
        return torch.stack(_ragged_advantages(list(rewards.unbind(0)), scale, eps))
    groups = list(rewards)
    if not groups:
        raise ValueError("rewards must hold at least one group, got an empty sequence")
    for i, g in enumerate(groups):
        if g.dim() != 1 or g.numel() == 0:
            raise ValueError(f"rewards[{i}] must be a non-empty 1-D tensor, got {tuple(g.shape)}")
    return _ragged_advantages(groups, scale, eps)


def _ragged_advantages(groups: list[torch.Tensor], scale: AdvantageScale, eps: float) -> list[torch.Tensor]:
    groups = [g.to(torch.promote_types(g.dtype, torch.float32)) for g in groups]
    batch_std = _batch_std(groups) if scale == "batch" else None
    out = []
    for g in groups:
        if g.numel() == 1 or bool((g == g[0]).all()):
            out.append(torch.zeros_like(g))
            continue
        centred = g - g.mean()
        if scale == "group":
            centred = centred / (g.std() + eps)
        elif scale == "batch":
            centred = centred / (batch_std + eps) if batch_std > 0 else torch.zeros_like(g)
        out.append(centred)
    return out


def _batch_std(groups: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.cat(groups)
    return flat.std() if flat.numel() > 1 else flat.new_zeros(())
