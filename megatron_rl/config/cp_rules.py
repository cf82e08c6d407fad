"""The rules of context parallelism (``parallel.cp``), across sections.

Contract: `check_cp(cfg)` yields ``(key, message)`` for a ``parallel.cp`` the run cannot use.
At cp = c > 1 every prompt and response of a packed micro-batch is cut into 2c chunks and each
CP rank attends its chunks' queries to the all-gathered K / V (`attention/cp_split.py`,
`attention/context_parallel.py`, every attention backend): any token budget splits, and
``model.megatron`` may not set megatron's own CP options
(Transformer Engine ring attention: not what runs). MoE composes: routing is per token, expert
parallelism takes its ranks from DP × CP as in megatron, and the router losses of a rank's
uneven slice are made exact by ``platform/patches/moe_cp_router_losses``; replayed routes
(``algorithm.routing_replay: rollout``) are sliced per rank as the tokens are (``trimodel.stage``).
The world-size rule (tp × pp × cp × dp) is `validate.validate_world`'s and `plan`'s.
`cp_sizes(cfg, world)` lists the CP sizes above the config's that a world of `world` training
ranks allows and these rules accept (what `plan` may suggest).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from .schema import Config

Found = Iterator[tuple[str, str]]
# megatron's own context-parallel options (TE ring attention, hierarchical a2a): not used here
MEGATRON_CP_OPTIONS = ("cp_comm_type", "hierarchical_context_parallel_sizes")


def check_cp(cfg: Config) -> Found:
    """Problems of ``parallel.cp`` with the rest of the config (nothing at cp 1)."""
    cp = cfg.parallel.cp
    if cp == 1:
        return
    for name in MEGATRON_CP_OPTIONS:
        if name in cfg.model.megatron:
            yield (
                f"model.megatron.{name}",
                "megatron's own context parallelism (Transformer Engine ring attention) is not used: "
                "parallel.cp runs megatron_rl's all-gather CP with shared-prompt attention; remove it",
            )


def cp_sizes(cfg: Config, world: int) -> list[int]:
    """CP sizes above ``parallel.cp``, smallest first, that `world` training ranks allow at the
    config's tp / pp / ep (tp × pp × cp divides the world, ep divides DP × CP: megatron's expert
    groups span the CP ranks) and that `check_cp` accepts."""
    p = cfg.parallel
    out = []
    for c in range(p.cp + 1, world // (p.tp * p.pp) + 1):
        if world % (p.tp * p.pp * c) or (world // (p.tp * p.pp)) % p.ep:
            continue
        if not list(check_cp(dataclasses.replace(cfg, parallel=dataclasses.replace(p, cp=c)))):
            out.append(c)
    return out
