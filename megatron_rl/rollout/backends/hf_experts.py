"""HF checkpoint names of MoE experts -> the fused expert tensors of a transformers 5 model.

Checkpoints and the trainer's weight export name each expert's matrices on their own
(``...experts.3.gate_proj.weight``; Mixtral: ``w1`` / ``w3`` / ``w2``), but transformers 5
models hold one 3-D tensor per kind in memory (its ``conversion_mapping`` fuses them at load):
``experts.gate_up_proj [E, 2·I, H]`` (gate rows, then up rows, per expert) and
``experts.down_proj [E, H, I]``. Some also rename a module at load (Mixtral:
``block_sparse_moe`` -> ``mlp``, router included). ``model_slot(name, targets)`` says where a
checkpoint-named tensor goes.
"""

from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
# transformers 5's load-time renames (its conversion_mapping's WeightRenaming), checkpoint -> model
_RENAMES = ((".block_sparse_moe.", ".mlp."),)
_FUSED = {
    "gate_proj": ("gate_up_proj", 0),
    "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w2": ("down_proj", None),
}


def model_slot(name: str, targets: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    """(model parameter name, the tensor or view of it that checkpoint tensor ``name`` fills),
    or None when the model has no place for it."""
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return (name, targets[name]) if name in targets else expert_slot(name, targets)


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
