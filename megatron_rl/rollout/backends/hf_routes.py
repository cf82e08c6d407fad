"""The ``hf`` engine's record of MoE routing: which experts each forwarded token went to.

transformers 5 MoE blocks (Qwen3-MoE, Qwen2-MoE, Mixtral, ...) call a ``*TopKRouter`` module
that returns ``(router_logits, routing_weights, expert_indices)`` and then run exactly those
``expert_indices``: a forward hook on each router therefore records the choice the layer
*used* (not a top-k recomputed from logits, which could break ties differently). One call of
the model appends one ``[rows·seq, top_k]`` tensor per MoE layer; ``take`` lays them out as
``[rows, seq, layers, top_k]``: one column per decoder layer, as vLLM returns them (a dense
layer's column is zeros and is never read).
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"layers\.(\d+)\.")


def moe_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The model's top-k routers by decoder layer index (empty for a dense model)."""
    found = {}
    for name, m in model.named_modules():
        if type(m).__name__.lower().endswith("topkrouter"):
            match = _LAYER.search(name)
            if match is None:
                raise ValueError(f"router {name!r} is not inside a numbered decoder layer")
            found[int(match.group(1))] = m
    return found


class RouteRecorder:
    """Forward hooks on every router of ``model``; ``take`` returns what one model call routed."""

    def __init__(self, model: torch.nn.Module) -> None:
        routers = moe_routers(model)
        if not routers:
            arch = type(model).__name__
            raise ValueError(
                f"rollout: the hf engine's model {arch} has no top-k router to record routes from "
                "(algorithm.routing_replay: rollout needs an MoE model)"
            )
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self._layers = sorted(routers)  # hooks fire in layer order
        self._calls: list[torch.Tensor] = []
        self._handles = [routers[i].register_forward_hook(self._hook) for i in self._layers]

    def _hook(self, module, args, output) -> None:
        indices = output[2] if isinstance(output, tuple) and len(output) == 3 else None
        if indices is None or indices.is_floating_point():
            raise TypeError(f"{type(module).__name__} did not return (logits, weights, expert indices)")
        self._calls.append(indices.detach())

    def take(self, rows: int, seq: int) -> torch.Tensor:
        """``[rows, seq, layers, top_k]`` int16 (host) of the model call that just ran; resets."""
        calls, self._calls = self._calls, []
        if len(calls) != len(self._layers):
            raise RuntimeError(f"recorded {len(calls)} router calls for one forward of {len(self._layers)} MoE layers")
        out = torch.zeros(rows, seq, self.num_layers, calls[0].shape[-1], dtype=torch.int16)
        for layer, c in zip(self._layers, calls, strict=True):
            out[:, :, layer] = c.reshape(rows, seq, -1).cpu()
        return out

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
