"""Which device of which node does what: training ranks (TP/PP/DP coordinates) and engines.

Contract (what `examples/launch.sh` and `examples/launch_msrun.sh` launch):

- Nodes are alike. ``rollout.devices`` names the engine devices of ONE node by local id
  (``"npu:6,7"``); every node runs that set of engines, so the pool has nodes × num_engines
  engines. Engine processes set their own ``*_VISIBLE_DEVICES`` from these ids.
- Training ranks take the node's other devices: local rank i uses device i (torch's
  ``set_device(LOCAL_RANK)``), so engine ids must lie at or above the number of training
  ranks per node, and below ``--devices-per-node``. The launcher starts that many ranks per
  node (``NPROC_PER_NODE``); global rank = node × ranks per node + local rank.
- The TP / PP / DP coordinates of a global rank are megatron-core's (its ``RankGenerator``,
  order ``tp-cp-ep-dp-pp``: TP fastest, so a TP group stays inside a node when TP divides the
  ranks per node).
CPU engines (``"cpu:0-3"``, pinned cores) take no device.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.schema import Config
from megatron_rl.rollout.settings import parse_device


@dataclass(frozen=True, kw_only=True)
class RankPlace:
    """One training rank: where it runs and its megatron coordinates."""

    rank: int
    node: int
    local_rank: int  # also its device id on the node
    tp: int
    pp: int
    dp: int


@dataclass(frozen=True, kw_only=True)
class ClusterLayout:
    """The whole launch: training ranks and rollout engines, node by node."""

    nodes: int
    devices_per_node: int
    ranks_per_node: int
    tp: int
    pp: int
    dp: int
    ranks: tuple[RankPlace, ...]
    engine_devices: tuple[str, ...]  # rollout.devices: the engines of every node

    @property
    def world_size(self) -> int:
        return len(self.ranks)


class LayoutError(ValueError):
    """A launch layout that cannot work; the message names the key or flag to change."""


def engine_device_ids(cfg: Config) -> list[int]:
    """Device ids one node's engines occupy (CPU engines occupy none)."""
    ids: list[int] = []
    for i, text in enumerate(cfg.rollout.devices):
        device = parse_device(text, f"rollout.devices[{i}]")
        if device.kind != "cpu":
            ids += list(device.ids)
    return ids


def plan_layout(cfg: Config, *, nodes: int, devices_per_node: int) -> ClusterLayout:
    """Place training ranks and engines on `nodes` nodes of `devices_per_node` devices."""
    if nodes < 1 or devices_per_node < 1:
        raise LayoutError(f"--nodes ({nodes}) and --devices-per-node ({devices_per_node}) must be >= 1")
    engine_ids = engine_device_ids(cfg)
    if len(set(engine_ids)) != len(engine_ids):
        raise LayoutError(f"rollout.devices {cfg.rollout.devices} name a device twice")
    ranks_per_node = devices_per_node - len(engine_ids)
    if ranks_per_node < 1:
        raise LayoutError(f"rollout.devices {cfg.rollout.devices} take all {devices_per_node} devices of a node; "
                          "leave some for training or raise --devices-per-node")
    clash = [i for i in engine_ids if i < ranks_per_node or i >= devices_per_node]
    if clash:
        want = f"ids {ranks_per_node}..{devices_per_node - 1}"
        raise LayoutError(f"rollout.devices {cfg.rollout.devices}: device(s) {clash} are training devices or absent; "
                          f"training ranks use ids 0..{ranks_per_node - 1} (local rank = device), so name engine "
                          f"{want}")
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    world = nodes * ranks_per_node
    if world % (tp * pp):
        raise LayoutError(f"parallel.tp ({tp}) × parallel.pp ({pp}) = {tp * pp} does not divide the {world} training "
                          f"ranks ({nodes} node(s) × {ranks_per_node}); change parallel.tp / parallel.pp or the layout")
    dp = world // (tp * pp)
    if cfg.parallel.dp is not None and cfg.parallel.dp != dp:
        raise LayoutError(f"parallel.dp ({cfg.parallel.dp}) ≠ {dp} = {world} training ranks / (tp × pp); "
                          f"set parallel.dp to {dp} or leave it unset")
    coords = _coordinates(tp=tp, pp=pp, dp=dp)
    ranks = tuple(RankPlace(rank=r, node=r // ranks_per_node, local_rank=r % ranks_per_node, **coords[r])
                  for r in range(world))
    return ClusterLayout(nodes=nodes, devices_per_node=devices_per_node, ranks_per_node=ranks_per_node, tp=tp, pp=pp,
                         dp=dp, ranks=ranks, engine_devices=tuple(cfg.rollout.devices))


def _coordinates(*, tp: int, pp: int, dp: int) -> dict[int, dict[str, int]]:
    """Global rank -> {"tp", "pp", "dp"} index, as megatron-core's parallel state assigns them."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    out: dict[int, dict[str, int]] = {r: {} for r in range(tp * pp * dp)}
    for name in ("tp", "pp", "dp"):
        for group in gen.get_ranks(name):
            for index, rank in enumerate(group):
                out[rank][name] = index
    return out
