"""DAPO's data-side pieces: dynamic sampling and soft overlong punishment (Yu et al. 2025).

Contract: pure tensor functions applied before the loss. Dynamic sampling returns which
groups to keep (a group whose rewards are all equal has zero advantage everywhere and only
dilutes the token-level mean); the caller drops the others and, in DAPO, over-samples to
refill the batch. Overlong shaping returns a reward delta per response, added to the task
reward before advantages are computed. Clip-higher, the third DAPO piece, is
``LossSettings.clip_high`` in ``losses.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def dynamic_sampling_keep(rewards: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Boolean ``[n_groups]``: True for groups whose rewards are not all equal.

    ``rewards``: ``[n_groups, G]`` or a sequence of 1-D tensors (ragged groups). A group of
    one response has nothing to compare against and is dropped too. Equality is exact.
    """
    if isinstance(rewards, torch.Tensor):
        if rewards.dim() != 2:
            raise ValueError(f"rewards must be [n_groups, G], got shape {tuple(rewards.shape)}")
        return (rewards != rewards[:, :1]).any(dim=1)
    keep = []
    for i, g in enumerate(rewards):
        if g.dim() != 1:
            raise ValueError(f"rewards[{i}] must be 1-D, got shape {tuple(g.shape)}")
        keep.append(bool((g != g[:1]).any()) if g.numel() else False)
    return torch.tensor(keep, dtype=torch.bool)


def overlong_reward_delta(lengths: torch.Tensor, *, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """Soft overlong punishment, DAPO eq. 13, scaled by ``penalty``.

    ``lengths``: ``[B]`` response lengths in tokens. With L_max = ``max_len`` and
    L_cache = ``buffer``, the delta is 0 for |y| ≤ L_max − L_cache, falls linearly
    ``((L_max − L_cache) − |y|) / L_cache`` inside the buffer, and is −1 beyond L_max; all
    times ``penalty`` (DAPO uses 1). Returns ``[B]`` float32 (non-positive).
    """
    if max_len <= 0:
        raise ValueError(f"overlong max_len must be > 0, got {max_len}")
    if not 0 <= buffer <= max_len:
        raise ValueError(f"overlong buffer must be in [0, max_len={max_len}], got {buffer}")
    if penalty < 0:
        raise ValueError(f"overlong penalty must be >= 0, got {penalty}")
    lengths = lengths.to(torch.float32)
    start = float(max_len - buffer)
    inside = (start - lengths) / buffer if buffer > 0 else torch.zeros_like(lengths)
    delta = torch.where(lengths <= start, torch.zeros_like(lengths), inside)
    delta = torch.where(lengths > max_len, torch.full_like(lengths, -1.0), delta)
    return penalty * delta
