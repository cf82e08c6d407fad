"""HF checkpoint names of MoE experts -> the fused expert tensors of a transformers 5 model.

Checkpoints and the trainer's weight export name each expert's matrices on their own
(``...experts.3.gate_proj.weight``; Mixtral: ``w1`` / ``w3`` / ``w2``), but transformers 5
models hold one 3-D tensor per kind in memory (its ``conversion_mapping`` fuses them at load):
``experts.gate_up_proj [E, 2·I, H]`` (gate rows, then up rows, per expert) and
``experts.down_proj [E, H, I]``. ``expert_slot(name, targets)`` says where such a tensor goes.
"""

from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}


def expert_slot(name: str, targets: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    """(fused parameter name, the view of it ``name`` fills), or None when ``name`` is no
    per-expert tensor of a fused model."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    fused, half = _FUSED[match["kind"]]
    target_name = f"{match['prefix']}.{fused}"
    if target_name not in targets:
        return None
    view = targets[target_name][int(match["e"])]
    if half is not None:
        view = view.chunk(2, dim=0)[half]
    return target_name, view
